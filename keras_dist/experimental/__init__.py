"""Experimental parts of keras_dist (``tf.distribute.experimental`` counterparts)."""

from keras_dist.experimental._central_storage import (
    CentralStorageStrategy as CentralStorageStrategy,
)
from keras_dist.experimental._value_context import ValueContext as ValueContext

__all__ = ["CentralStorageStrategy", "ValueContext"]
