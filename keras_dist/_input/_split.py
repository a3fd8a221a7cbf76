"""Splitting global batches between replicas, and stepping per-worker pipelines together.

An evenly divisible global batch becomes one stacked array placed on the mesh
with a single transfer; a partial last batch is split as TF splits it
(``ceil(rows / replicas)`` per replica in replica order: 10 rows on 4 replicas
give 3, 3, 3, 1; 1 row on 2 replicas gives 1, 0). Across
processes every worker reads the same global batch and keeps its replicas'
pieces, and per-worker pipelines agree on each step's batch sizes.
"""

import jax
import numpy as np

from keras_dist._input._host_arrays import to_host_array
from keras_dist._input._static_shapes import has_scalar_leaf
from keras_dist._values import PerReplica


def _as_array(x):
    return x if isinstance(x, jax.Array) else np.asarray(to_host_array(x))


class GlobalBatchSplitter:
    """Splits one global batch (a nest of arrays) into per-replica ``PerReplica`` leaves.

    With ``on_host=True`` an evenly split NumPy batch stays on the host, stacked
    ``(replicas, rows, ...)``: the compiled step takes it as an argument and
    places it itself, which costs a third of a separate ``device_put`` on CPU
    (``fit`` uses this; a distributed dataset places batches ahead of use).

    Across processes every worker reads the same global batch and keeps its
    replicas' pieces: with ``strided`` pieces ``w, w + W, ...`` of worker ``w``
    of ``W`` (TF's rebatching followed by DATA sharding, so its values are
    TF's), otherwise its consecutive ones (replica order is batch order, which
    ``predict`` relies on). Workers with different replica counts always take
    consecutive pieces (TF has no such clusters to follow).
    """

    def __init__(self, extended, on_host=False, strided=False):
        self._extended = extended
        self._on_host = on_host
        self._strided = strided
        # One sharding object for every batch: a program taking them sees it is
        # the one it saw last (``PlacedAlike``), without comparing two kinds.
        self._device = jax.sharding.SingleDeviceSharding(extended.local_devices[0])

    def _mine(self, pieces):
        """This process's share of the ``num_replicas_in_sync`` pieces of a batch."""
        extended = self._extended
        if not extended.spans_processes:
            return pieces
        if self._strided and extended.placement.same_replicas_per_process:
            return pieces[extended.worker_index :: extended.num_workers]
        start = extended.first_local_replica_id
        return pieces[start : start + extended.num_local_replicas]

    def __call__(self, batch):
        leaves, treedef = jax.tree_util.tree_flatten(batch)
        leaves = [_as_array(x) for x in leaves]
        size = _rows(leaves)
        n = self._extended.num_replicas_in_sync
        if size % n == 0:
            split = [self._stacked(x, n) for x in leaves]
        else:
            bounds = np.cumsum([0] + split_sizes(size, n, like_tf=not self._on_host))
            pieces = self._mine([(bounds[i], bounds[i + 1]) for i in range(n)])
            split = []
            for x in leaves:
                value = PerReplica(
                    tuple(
                        jax.device_put(x[start:stop], device)
                        for (start, stop), device in zip(pieces, self._extended.local_devices)
                    ),
                    _validate=False,
                )
                value.uneven_across_processes = self._extended.spans_processes
                split.append(value)
        return jax.tree_util.tree_unflatten(treedef, split)

    def whole(self, batch):
        """One replica's batch, as TF hands it to the step: the arrays themselves, on its
        device (one transfer for them all; one process only)."""
        leaves, treedef = jax.tree_util.tree_flatten(batch)
        leaves = [_as_array(x) for x in leaves]
        _rows(leaves)
        placed = jax.device_put(leaves, self._device)
        return jax.tree_util.tree_unflatten(treedef, placed)

    def _stacked(self, x, n):
        (stacked,) = stacked_rows([x], n)
        if self._extended.spans_processes:
            rows = self._mine(list(range(n)))
            return PerReplica(
                None, _stacked=self._extended.placement.put_local_rows(np.asarray(stacked)[rows])
            )
        if not (self._on_host and isinstance(stacked, np.ndarray)):
            stacked = jax.device_put(stacked, self._extended.placement.split)
        return PerReplica(None, _stacked=stacked)


def _rows(leaves) -> int:
    """The rows of a global batch's arrays; raises unless they share a leading dimension > 0."""
    sizes = {x.shape[0] if x.ndim else None for x in leaves}
    if None in sizes or len(sizes) != 1:
        raise ValueError(
            "Every array of a global batch needs the same leading (batch) dimension "
            "to be split between replicas. Batch the dataset first. Received: "
            f"shapes={[x.shape for x in leaves]}"
        )
    (size,) = sizes
    if size == 0:
        # Only a whole global batch with no rows is an error: a partial last
        # batch smaller than the replica count still gives some replicas 0 rows.
        raise ValueError(
            "A global batch has 0 rows, so there is nothing to split between the "
            "replicas. Remove empty batches from the dataset (or filter them out "
            f"before distributing it). Received: shapes={[x.shape for x in leaves]}"
        )
    return size


def splits_evenly(leaves, n: int) -> bool:
    """Whether ``leaves`` are a host batch's NumPy arrays whose rows ``n`` replicas share evenly.

    >>> splits_evenly([np.zeros((4, 2)), np.zeros(4)], 2), splits_evenly([np.zeros((3, 2))], 2)
    (True, False)
    """
    return bool(leaves) and all(
        type(x) is np.ndarray and x.ndim and x.shape[0] % n == 0 for x in leaves
    )


def stacked_rows(leaves, n: int) -> list:
    """Each of ``leaves`` (rows that split evenly) as ``(n, rows / n, ...)``: one row per replica.

    >>> [x.shape for x in stacked_rows([np.zeros((4, 2))], 2)]
    [(2, 2, 2)]
    """
    return [x.reshape((n, x.shape[0] // n) + x.shape[1:]) for x in leaves]


def split_sizes(rows: int, replicas: int, like_tf: bool = True) -> list:
    """How many rows of a partial global batch each replica gets, in replica order.

    TF's rebatching gives every replica ``ceil(rows / replicas)`` rows until
    the batch runs out (178 rows on 4 replicas: 45, 45, 45, 43; 10 rows: 3, 3, 3,
    1; 1 row: 1, 0, 0, 0). ``fit`` splits as evenly as possible instead (10 rows:
    3, 3, 2, 2): its steps are exact for any split, and even pieces balance the work.

    >>> split_sizes(178, 4), split_sizes(10, 4), split_sizes(10, 4, like_tf=False)
    ([45, 45, 45, 43], [3, 3, 3, 1], [3, 3, 2, 2])
    """
    if not like_tf:
        return [len(a) for a in np.array_split(np.arange(rows), replicas)]
    each = -(-rows // replicas)
    return [max(0, min(each, rows - i * each)) for i in range(replicas)]


def per_replica_batches(extended, batches, template=None, uneven=False):
    """One step from one batch per local replica; missing ones become empty batches.

    ``template`` gives the structure of an empty batch when no replica here has
    one; ``uneven`` marks the step as uneven across processes. Unbatched scalar
    elements have no empty batch: a step that misses one ends the input (TF
    takes one element per replica and stops at an incomplete round).
    """
    present = [b for b in batches if b is not None]
    template = jax.tree_util.tree_map(_as_array, present[0] if present else template)
    if len(present) < len(batches) and has_scalar_leaf(template):
        raise StopIteration
    filled = [
        b if b is not None else jax.tree_util.tree_map(lambda x: x[:0], template) for b in batches
    ]
    per_leaf = [jax.tree_util.tree_leaves(b) for b in filled]
    treedef = jax.tree_util.tree_structure(template)
    leaves = []
    for column in zip(*per_leaf):
        column = [_as_array(c) for c in column]
        if not uneven and len({c.shape for c in column}) == 1:
            stacked = np.stack([np.asarray(c) for c in column])
            leaves.append(PerReplica(None, _stacked=extended.placement.put_local_rows(stacked)))
        else:
            value = PerReplica(
                tuple(jax.device_put(c, d) for c, d in zip(column, extended.local_devices)),
                _validate=False,
            )
            value.uneven_across_processes = uneven
            leaves.append(value)
    return jax.tree_util.tree_unflatten(treedef, leaves)


class AgreedSteps:
    """Steps of per-worker pipelines that every worker takes together.

    Workers' pipelines may end at different steps (TF: a worker whose data ran
    out gets empty batches until every worker's has). Each step the workers
    exchange their replicas' batch sizes with one small collective, on the
    caller's thread: collectives must run in the same order on every process.
    """

    def __init__(self, extended, read_local):
        self._extended = extended
        self._read_local = read_local  # -> one batch or None per local replica
        self._template = None

    def __call__(self):
        extended = self._extended
        try:
            batches = self._read_local()
        except StopIteration:  # this worker's data ended; others' may not have
            batches = [None] * extended.num_local_replicas
        sizes = np.zeros(extended.num_replicas_in_sync, np.int32)
        for i, batch in enumerate(batches):
            # Rows + 1, so that an empty batch still counts as present.
            sizes[extended.first_local_replica_id + i] = (
                0 if batch is None else batch_rows(batch) + 1
            )
        sizes = np.asarray(extended.placement.cross_process_sum(sizes))
        if not sizes.any():
            raise StopIteration
        present = [b for b in batches if b is not None]
        if present:
            self._template = present[0]
        elif self._template is None:
            raise ValueError(
                "This worker's input pipeline produced no batch before the other "
                "workers' ended, so the structure of its empty batches is unknown. Give "
                "every worker at least one batch. Received: an empty pipeline on worker "
                f"{extended.worker_index}"
            )
        if not sizes.all() and has_scalar_leaf(self._template):
            raise StopIteration  # decided on every worker alike: the sizes are global
        uneven = len(set(np.maximum(sizes - 1, 0).tolist())) > 1
        return per_replica_batches(extended, batches, self._template, uneven)


def batch_rows(batch) -> int:
    """The number of rows of a batch (its first non-scalar leaf's leading dimension)."""
    leaves = [x for x in jax.tree_util.tree_leaves(batch) if np.ndim(x) > 0]
    return int(np.shape(leaves[0])[0]) if leaves else 1


class RebatchedForEveryWorker:
    """AutoShardPolicy.OFF across processes: every worker reads all of the data.

    Each global batch is cut into per-replica batches of ``global / replicas``
    rows, and each worker's replicas take them in turn (TF's rebatching
    without sharding: range(12).batch(8) on 2 workers gives each worker
    [0..3], [4..7], [8..11]).
    """

    def __init__(self, extended, dataset):
        self._extended = extended
        self._dataset = dataset

    def __call__(self):
        extended = self._extended
        iterator = iter(self._dataset)
        pending = []
        rows = None
        template = None

        def next_fn():
            nonlocal rows, template
            while len(pending) < extended.num_local_replicas:
                batch = next(iterator, None)
                if batch is None:
                    break
                batch = jax.tree_util.tree_map(_as_array, batch)
                template = batch
                size = batch_rows(batch)
                rows = rows or max(1, size // extended.num_replicas_in_sync)
                for start in range(0, size, rows):
                    pending.append(
                        jax.tree_util.tree_map(lambda x, s=start: x[s : s + rows], batch)
                    )
            if not pending:
                raise StopIteration
            step = pending[: extended.num_local_replicas]
            del pending[: extended.num_local_replicas]
            step += [None] * (extended.num_local_replicas - len(step))
            return per_replica_batches(extended, step, template)

        return next_fn
