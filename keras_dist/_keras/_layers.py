"""Keras layers under a strategy: batch-norm statistics, empty batches and each
replica's own random draws."""

import functools
import threading

import jax

from keras_dist import _context
from keras_dist._keras._internals import BatchNormalization
from keras_dist._keras._internals import SeedGenerator

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


def _wrap_batch_norm_call(original):
    """A replica without rows leaves its moving statistics as they are, as tf.keras's
    ``_support_zero_size_input`` does: their moments over 0 rows would be NaN.

    A last batch smaller than the replica count gives some replicas no rows; such a
    replica's call runs in inference mode (its output has no rows either way).
    """

    @functools.wraps(original)
    def call(self, inputs, training=None, mask=None):
        shape = tuple(getattr(inputs, "shape", ()))
        if training and shape[:1] == (0,) and _context.has_strategy():
            training = False
        return original(self, inputs, training=training, mask=mask)

    return call


def _wrap_seed_next(original):
    """Each replica draws its own random numbers, as tf.keras's replicas do.

    A ``SeedGenerator``'s state is a mirrored variable: every replica holds the
    same and moves it on alike, so every replica drew the same seed, and a
    ``Dropout`` dropped the same rows of every replica's part of the batch (the
    noise of one replica's rows repeated, unlike one device's). The seed a
    replica gets has its replica id folded in; the state moves on as before.
    One replica draws Keras's own seeds.
    """

    @functools.wraps(original)
    def next(self, ordered=True):
        seed = original(self, ordered)
        replica_context = _context.running_replica_context()
        if (
            replica_context is None
            or replica_context.num_replicas_in_sync == 1
            or not isinstance(seed, jax.Array)  # (a NumPy generator's, for data pipelines)
        ):
            return seed
        return jax.random.fold_in(seed, replica_context.replica_id_in_sync_group)

    return next


def install_layer_hooks() -> None:
    """Batch-norm statistics per replica (as tf.keras); a replica without rows leaves
    them as they are; each replica's random draws are its own."""
    if getattr(BatchNormalization.build, "_keras_dist_hook", False):
        return
    BatchNormalization.build = _wrap_batch_norm_build(BatchNormalization.build)
    BatchNormalization.call = _wrap_batch_norm_call(BatchNormalization.call)
    SeedGenerator.next = _wrap_seed_next(SeedGenerator.next)
