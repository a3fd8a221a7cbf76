"""Keras layers and losses under a strategy: batch-norm statistics and empty batches."""

import functools
import threading

from keras import ops

from keras_dist import _context
from keras_dist._keras._internals import BatchNormalization
from keras_dist._keras._internals import loss_module

_batch_norm_building = threading.local()


def building_batch_norm() -> bool:
    """Whether variables are being created by ``BatchNormalization.build``."""
    return getattr(_batch_norm_building, "active", False)


def _wrap_batch_norm_build(original):
    @functools.wraps(original)
    def build(self, input_shape):
        _batch_norm_building.active = True
        try:
            return original(self, input_shape)
        finally:
            _batch_norm_building.active = False

    build._keras_dist_hook = True
    return build


def _wrap_reduce_values(original):
    """An empty batch's loss reduces to 0 under a strategy, as in tf-keras.

    A last batch smaller than the replica count leaves some replicas no rows.
    tf-keras reduces their loss to 0 (``divide_no_nan``); Keras 3's
    ``losses.loss.reduce_values`` returns the empty array itself, which breaks
    the gradient (not a scalar) and turns the loss metric into NaN.
    """

    @functools.wraps(original)
    def reduce_values(values, sample_weight=None, reduction="sum_over_batch_size"):
        shape = tuple(getattr(values, "shape", ()))
        if reduction not in (None, "none") and 0 in shape and _context.has_strategy():
            return ops.zeros((), dtype=values.dtype)
        return original(values, sample_weight, reduction)

    return reduce_values


def install_layer_hooks() -> None:
    """Batch-norm statistics per replica (as tf.keras); empty batches' losses are 0."""
    if getattr(BatchNormalization.build, "_keras_dist_hook", False):
        return
    BatchNormalization.build = _wrap_batch_norm_build(BatchNormalization.build)
    loss_module.reduce_values = _wrap_reduce_values(loss_module.reduce_values)
