"""Experimental parts of keras_dist (``tf.distribute.experimental`` counterparts)."""

from keras_dist._values._value_context import ValueContext as ValueContext
from keras_dist.strategies import CentralStorageStrategy as CentralStorageStrategy
from keras_dist.strategies import CollectiveCommunication as CollectiveCommunication
from keras_dist.strategies import CommunicationImplementation as CommunicationImplementation
from keras_dist.strategies import CommunicationOptions as CommunicationOptions
from keras_dist.strategies import (
    ExperimentalMultiWorkerMirroredStrategy as MultiWorkerMirroredStrategy,
)

__all__ = [
    "CentralStorageStrategy",
    "CollectiveCommunication",
    "CommunicationImplementation",
    "CommunicationOptions",
    "MultiWorkerMirroredStrategy",
    "ValueContext",
]
