"""Experimental parts of keras_dist (``tf.distribute.experimental`` counterparts)."""

from keras_dist import coordinator as coordinator
from keras_dist._values._value_context import ValueContext as ValueContext
from keras_dist.experimental import partitioners as partitioners
from keras_dist.parameter_server._data import DatasetCreator as DatasetCreator
from keras_dist.parameter_server.variables._sharded import ShardedVariable as ShardedVariable
from keras_dist.strategies import CentralStorageStrategy as CentralStorageStrategy
from keras_dist.strategies import CollectiveCommunication as CollectiveCommunication
from keras_dist.strategies import CollectiveHints as CollectiveHints
from keras_dist.strategies import CommunicationImplementation as CommunicationImplementation
from keras_dist.strategies import CommunicationOptions as CommunicationOptions
from keras_dist.strategies import (
    ExperimentalMultiWorkerMirroredStrategy as MultiWorkerMirroredStrategy,
)
from keras_dist.strategies import ParameterServerStrategy as ParameterServerStrategy
from keras_dist.strategies import TPUStrategy as TPUStrategy
from keras_dist.train._preemption_handler import (
    PreemptionCheckpointHandler as PreemptionCheckpointHandler,
)
from keras_dist.train._termination import TerminationConfig as TerminationConfig

__all__ = [
    "CentralStorageStrategy",
    "CollectiveCommunication",
    "CollectiveHints",
    "CommunicationImplementation",
    "CommunicationOptions",
    "DatasetCreator",
    "MultiWorkerMirroredStrategy",
    "ParameterServerStrategy",
    "PreemptionCheckpointHandler",
    "ShardedVariable",
    "TPUStrategy",
    "TerminationConfig",
    "ValueContext",
    "coordinator",
    "partitioners",
]
