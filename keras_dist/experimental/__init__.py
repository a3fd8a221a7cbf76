"""Experimental parts of keras_dist (``tf.distribute.experimental`` counterparts)."""

from keras_dist.experimental._value_context import ValueContext as ValueContext

__all__ = ["ValueContext"]
