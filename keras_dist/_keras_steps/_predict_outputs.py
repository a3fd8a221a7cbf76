"""``predict``'s outputs: a padded batch's rows, joined from the replicas (and workers).

>>> import numpy as np
>>> pad_rows(np.arange(3), 5).tolist()
[0, 1, 2, 2, 2]
"""

import jax
import numpy as np

from keras_dist._engine._gate import needs_serializing
from keras_dist._values import PerReplica


def pad_rows(x, rows):
    """``x`` with its last row repeated up to ``rows`` rows."""
    if x.ndim == 0 or x.shape[0] == rows:
        return x
    padding = np.repeat(x[-1:], rows - x.shape[0], axis=0)
    return np.concatenate([x, padding])


def predicted_rows(extended, value, rows):
    """A predict step's output for the batch's ``rows`` (its padding cut off).

    One replica's output stays on its device, as plain Keras's does: Keras joins
    the batches' outputs at the end, so the next batch is dispatched without
    waiting for this one. Several replicas' are joined on the host now, and so is
    a replica's on several CPU devices: cutting its padding off there would be an
    execution outside the gate (``_engine/_gate.py``).
    """
    if extended.spans_processes and not _is_stacked(value):
        # An eager step's: this worker's replicas' rows; every worker's, gathered in order.
        return np.asarray(extended.gather_value(value, 0))[:rows]
    if (
        isinstance(value, jax.Array)
        and not isinstance(value, jax.core.Tracer)
        and not needs_serializing(list(value.sharding.device_set))
    ):
        return value if value.shape[0] == rows else value[:rows]
    return _concatenate_replicas(extended, value)[:rows]


def _is_stacked(value) -> bool:
    return isinstance(value, PerReplica) and value.stacked is not None


def _concatenate_replicas(extended, value):
    if _is_stacked(value):
        stacked = np.asarray(extended.placement.all_rows(value.stacked))
        return stacked.reshape((-1,) + stacked.shape[2:])
    if isinstance(value, PerReplica):
        return np.concatenate([np.asarray(c) for c in value.values])
    return np.asarray(value)
