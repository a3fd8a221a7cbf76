"""``fit``'s next batch on the accelerators while the current step runs, as Keras's own loop.

Keras's JAX loop puts each batch on the GPU one step ahead
(``JAXEpochIterator._one_batch_ahead_iterator``), so that copying it overlaps
the step before. A strategy's step that is handed NumPy rows copies them when
it is dispatched instead: on an H100 a ``MirroredStrategy`` fit step of an MLP
with 4 MB batches took 1.21 ms against plain Keras's 1.06 ms. Here the
batches ``fit`` reads are put on the replicas' devices one step ahead, stacked
and split as the step's program takes them, and ``RepeatedSteps`` hands those
to the program in place of the NumPy rows (then 0.95 ms against 1.13 ms).

Only on accelerators: on CPU devices the copy is a memcpy that nothing
overlaps. ``evaluate``'s and ``predict``'s steps take them too. A batch put
ahead that no step takes (``steps_per_execution`` batches, a partial batch)
is dropped; after two in a row the loop stops putting batches ahead.
"""

import collections
import operator
import threading

import jax

from keras_dist._capabilities import MeshRuntime
from keras_dist._input import splits_evenly
from keras_dist._input import stacked_rows

_MAX_MISSES = 2  # batches put ahead in a row that no step took: stop putting them ahead


def puts_ahead(extended) -> bool:
    """Whether ``fit`` under this strategy puts batches on its devices a step ahead."""
    if not isinstance(extended, MeshRuntime) or extended.spans_processes:
        return False
    return extended.placement.local_devices[0].platform != "cpu"


def batches_ahead(batches, extended):
    """``batches`` unchanged, each put on ``extended``'s devices before the one before
    it is read (its rows then wait in ``PLACED_AHEAD`` for the step that reads it)."""
    misses, pending, pending_leaves = 0, None, None
    for batch in batches:
        leaves = PLACED_AHEAD.put(batch, extended) if misses < _MAX_MISSES else None
        if pending is not None:
            yield pending
            if pending_leaves is not None:
                misses = misses + 1 if PLACED_AHEAD.drop(pending_leaves) else 0
        pending, pending_leaves = batch, leaves
    if pending is not None:
        yield pending
        if pending_leaves is not None:
            PLACED_AHEAD.drop(pending_leaves)


class PlacedAhead(threading.local):
    """Batches' rows put on the devices ahead, by the identity of their NumPy leaves.

    Per thread (each runs its own loop); at most two batches are held, so an
    abandoned loop holds no more than that on the devices.

    >>> import keras_dist as kd
    >>> import numpy as np
    >>> extended = kd.MirroredStrategy(["/cpu:0"]).extended
    >>> store = PlacedAhead()
    >>> batch = (np.ones((4, 2), "float32"),)
    >>> store.put(batch, extended) is not None
    True
    >>> [rows.shape for rows in store.take(list(batch), extended.placement.split)]
    [(1, 4, 2)]
    >>> store.take(list(batch), extended.placement.split) is None  # taken once
    True
    """

    def __init__(self):
        self._batches = collections.deque(maxlen=2)  # (leaves, stacked rows on the devices)

    def put(self, batch, extended):
        """Starts copying ``batch``'s rows to ``extended``'s devices; its leaves, or
        ``None`` where its rows do not split evenly between the replicas (the step
        copies those itself)."""
        leaves = jax.tree_util.tree_leaves(batch)
        n = extended.num_replicas_in_sync
        if not splits_evenly(leaves, n):
            return None
        stacked = stacked_rows(leaves, n)
        self._batches.append((leaves, jax.device_put(stacked, extended.placement.split)))
        return leaves

    def take(self, leaves: list, sharding):
        """The rows put ahead for ``leaves`` (the same arrays), placed by ``sharding``,
        or ``None``; taken once."""
        index = self._index(leaves)
        if index is None:
            return None
        _, rows = self._batches[index]
        del self._batches[index]
        return rows if rows[0].sharding == sharding else None

    def drop(self, leaves: list) -> bool:
        """Forgets the rows of a batch (its ``leaves``, as ``put`` gave them); whether they
        were still there (no step took them)."""
        index = self._index(leaves)
        if index is not None:
            del self._batches[index]
        return index is not None

    def _index(self, leaves):
        for index, (kept, _) in enumerate(self._batches):
            if len(kept) == len(leaves) and all(map(operator.is_, kept, leaves)):
                return index
        return None


PLACED_AHEAD = PlacedAhead()
