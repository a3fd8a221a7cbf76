"""``fit``'s input with an auto-shard policy attached (``kd.data.with_auto_shard_policy``).

``fit`` splits each global batch between every worker's replicas, each worker
keeping its own pieces: TF's AUTO and DATA policies give the same steps, so
their input is passed on as it is. ``AutoShardPolicy.OFF`` has every worker
read all of the data (TF's rebatching without sharding): each global batch is
cut into per-replica pieces of ``global / replicas`` rows, and each worker's
replicas take them in turn, so every worker trains on the same rows in a step
(``EveryWorkerReadsAll``).
"""

import jax
import numpy as np

from keras_dist._capabilities import MeshRuntime
from keras_dist._capabilities import RemoteScheduling
from keras_dist._input import DistributedDataset
from keras_dist._input import JoinedReplicas
from keras_dist._input import NumpyDataset
from keras_dist._input import batch_rows
from keras_dist._input._endless import refuse_endless
from keras_dist._input._host_arrays import to_host_arrays
from keras_dist._keras import DataAdapter
from keras_dist._keras import get_data_adapter
from keras_dist.data import AutoShardPolicy
from keras_dist.data._sharding import policy_of
from keras_dist.data._sharding import without_policy


def loop_input(data, strategy, shuffle=False, steps=None, names=("x", "steps_per_epoch")):
    """``data`` as Keras's loops should read it, its auto-shard policy applied.

    ``shuffle`` is the loop's: Keras's adapter of the data shuffles it (a
    ``PyDataset``'s batch order) when it would without a policy. A batched
    ``NumpyDataset`` (``strategy.experimental_make_numpy_dataset``, the
    counterpart of ``tf.data``'s ``from_tensor_slices(...).batch(n)``) is read
    batch by batch, in order, as ``fit`` reads a ``tf.data`` dataset. A
    ``DistributedDataset`` (TF's Keras takes one) is read as the global batches
    it splits. ``steps``: the loop's steps for it (``steps_per_epoch``), -1 to
    read it to its end (tf-keras's); ``names``: the argument and its steps'.

    Without steps, a dataset that never ends is refused (a distributed one, or any
    under a strategy; a distributed one of unknown length is read with a warning).
    """
    extended = None if strategy is None else strategy.extended
    steps_given = steps is not None
    if not steps_given and (strategy is not None or isinstance(data, DistributedDataset)):
        distributed = isinstance(data, DistributedDataset)
        sources = data.sources if distributed else (without_policy(data),)
        refuse_endless(sources, *names, distributed=distributed)
    if steps == -1 and getattr(data, "keras_dist_needs_steps", False):
        # A pipeline built here (``DatasetCreator``), endless to Keras: one pass of it.
        # (On a parameter-server coordinator the workers read it: TF's -1 never ends there.)
        if not (isinstance(extended, RemoteScheduling) and extended.schedules_on_workers):
            data = _Batches(data.to_the_end())
    distributed = isinstance(data, DistributedDataset)
    if distributed:
        data = data.global_batches()
        if isinstance(data, JoinedReplicas):
            data = _Batches(data)
    policy = policy_of(data)
    data = without_policy(data)
    if isinstance(data, NumpyDataset):
        data = NumpyDatasetAdapter(data)
    if distributed and not _read_as_batches_by_keras(data):
        data = _Batches(data)
    if policy is AutoShardPolicy.OFF and isinstance(extended, MeshRuntime):
        if extended.spans_processes:
            adapter = data
            if not isinstance(adapter, DataAdapter):
                adapter = get_data_adapter(data, shuffle=shuffle)
            return EveryWorkerReadsAll(
                adapter,
                extended.num_workers,
                extended.num_local_replicas,
                steps_given and steps != -1,
            )
    return data


def _read_as_batches_by_keras(batches) -> bool:
    """Whether Keras's loops read a distributed dataset's source as its batches: Keras
    takes a list of batches for arrays, and an iterable of its own type for nothing."""
    if isinstance(batches, DataAdapter):
        return True
    if isinstance(batches, (list, tuple)):
        return False
    try:
        get_data_adapter(batches)
    except ValueError:
        return False
    return True


class _HostBatches(DataAdapter):
    """An adapter of NumPy batches that Keras's loops read as it does its own.

    What a subclass cannot tell ahead is ``None``, as Keras's adapters answer.
    """

    def get_jax_iterator(self):
        return self.get_numpy_iterator()

    @property
    def num_batches(self):
        return None

    @property
    def batch_size(self):
        return None

    @property
    def has_partial_batch(self):
        return None

    @property
    def partial_batch_size(self):
        return None


class _Batches(_HostBatches):
    """A re-iterable of host batches (a distributed dataset's joined elements) for Keras."""

    def __init__(self, batches):
        self._batches = batches

    def get_numpy_iterator(self):
        return iter(self._batches)


class EveryWorkerReadsAll(_HostBatches):
    """Global batches in which this step's per-replica pieces stand once per worker.

    ``fit`` keeps each worker's pieces of a global batch; here every worker's
    pieces are the same: the next ``local_replicas`` pieces of the data, in
    replica order, read through ``adapter`` (Keras's adapter of the data). The
    number of steps is not known ahead (it changes with the piece size): give
    ``steps_per_epoch``. With it (``endless``), the pieces go on from the data's
    start when it ends, as Keras goes on with a ``PyDataset`` longer than an epoch
    and as TF's tutorials repeat their datasets: no epoch finds the data used up.

    >>> adapter = EveryWorkerReadsAll(
    ...     get_data_adapter((np.arange(8),) for _ in range(1)), num_workers=2, local_replicas=1)
    >>> [b[0].tolist() for b in adapter.get_numpy_iterator()]
    [[0, 1, 2, 3, 0, 1, 2, 3], [4, 5, 6, 7, 4, 5, 6, 7]]
    """

    def __init__(self, adapter, num_workers, local_replicas, endless=False):
        self._adapter = adapter
        self._num_workers = num_workers
        self._local_replicas = local_replicas
        self._endless = endless

    def get_numpy_iterator(self):
        while True:
            read_any = False
            for batch in self._one_pass():
                read_any = True
                yield batch
            if not (self._endless and read_any):  # (an empty dataset ends, endless or not)
                return

    def _one_pass(self):
        replicas = self._num_workers * self._local_replicas
        piece_rows = None
        pending = []
        for batch in self._adapter.get_numpy_iterator():
            batch = to_host_arrays(batch)
            rows = batch_rows(batch)
            # TF's rebatching: the first batch sets the per-replica size.
            piece_rows = piece_rows or max(1, rows // replicas)
            for start in range(0, rows, piece_rows):
                pending.append(
                    jax.tree_util.tree_map(lambda x, s=start: x[s : s + piece_rows], batch)
                )
            while len(pending) >= self._local_replicas:
                yield self._for_every_worker(pending[: self._local_replicas])
                del pending[: self._local_replicas]
        if pending:
            # Fewer pieces than replicas: fit spreads the rows over this worker's replicas.
            yield self._for_every_worker(pending)

    def on_epoch_begin(self):
        self._adapter.on_epoch_begin()

    def on_epoch_end(self):
        self._adapter.on_epoch_end()

    def _for_every_worker(self, pieces):
        return jax.tree_util.tree_map(
            lambda *parts: np.concatenate(parts * self._num_workers), *pieces
        )


class NumpyDatasetAdapter(_HostBatches):
    """A batched ``NumpyDataset`` as Keras's loops read it: its batches, in order, each epoch.

    >>> adapter = NumpyDatasetAdapter(NumpyDataset((np.arange(5), np.arange(5))).batch(2))
    >>> adapter.num_batches, [len(x) for x, _ in adapter.get_numpy_iterator()]
    (3, [2, 2, 1])
    """

    def __init__(self, dataset):
        if dataset.batch_size is None:
            raise ValueError(
                "`fit`, `evaluate` and `predict` take batches: call `.batch(n)` on the "
                "NumPy dataset first (as on a `tf.data` dataset). Received: an unbatched "
                f"NumpyDataset of {len(dataset)} rows"
            )
        self._dataset = dataset

    def get_numpy_iterator(self):
        return iter(self._dataset)

    @property
    def num_batches(self):
        return len(self._dataset)

    @property
    def batch_size(self):
        return self._dataset.batch_size
