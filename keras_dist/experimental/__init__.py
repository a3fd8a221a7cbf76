"""Experimental parts of keras_dist (``tf.distribute.experimental`` counterparts)."""

from keras_dist.strategies._multi_worker_mirrored import CollectiveCommunication as CollectiveCommunication
from keras_dist.strategies._multi_worker_mirrored import (
    CommunicationImplementation as CommunicationImplementation,
)
from keras_dist.strategies._multi_worker_mirrored import CommunicationOptions as CommunicationOptions
from keras_dist.strategies._multi_worker_mirrored import (
    ExperimentalMultiWorkerMirroredStrategy as MultiWorkerMirroredStrategy,
)
from keras_dist.strategies._central_storage import (
    CentralStorageStrategy as CentralStorageStrategy,
)
from keras_dist.experimental._value_context import ValueContext as ValueContext

__all__ = [
    "CentralStorageStrategy",
    "CollectiveCommunication",
    "CommunicationImplementation",
    "CommunicationOptions",
    "MultiWorkerMirroredStrategy",
    "ValueContext",
]
