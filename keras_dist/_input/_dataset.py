"""Distributed input: `InputContext`, `InputOptions`, and distributed datasets.

``experimental_distribute_dataset`` takes any re-iterable of *global* batches
(nests of NumPy or JAX arrays) and splits each between the local replicas:
an evenly divisible batch becomes one stacked array placed on the mesh with a
single transfer; a partial last batch is split as evenly as possible (as TF
does: 5 rows on 4 replicas give 2, 1, 1, 1; 1 row on 2 replicas gives 1, 0).
``distribute_datasets_from_function`` calls ``dataset_fn(InputContext)`` and
gives each replica its own batches in turn.
"""

import dataclasses
import enum

import jax
import numpy as np

from keras_dist import _context
from keras_dist._input._prefetch import Prefetch
from keras_dist._values._distributed_values import PerReplica


class InputReplicationMode(enum.Enum):
    """How ``distribute_datasets_from_function`` creates input pipelines.

    * ``PER_WORKER``: one pipeline per worker; its batches go to the worker's
      replicas in turn.
    * ``PER_REPLICA``: one pipeline per replica (``dataset_fn`` is called once
      per replica).
    """

    PER_WORKER = "PER_WORKER"
    PER_REPLICA = "PER_REPLICA"


@dataclasses.dataclass
class InputOptions:
    """Options for distributed input, as ``tf.distribute.InputOptions``.

    >>> InputOptions(experimental_replication_mode=InputReplicationMode.PER_REPLICA)
    ... # doctest: +ELLIPSIS
    InputOptions(experimental_fetch_to_device=None, ...)
    """

    experimental_fetch_to_device: "bool | None" = None
    experimental_replication_mode: InputReplicationMode = InputReplicationMode.PER_WORKER
    experimental_place_dataset_on_device: bool = False
    experimental_per_replica_buffer_size: int = 1

    def validate(self) -> None:
        if self.experimental_place_dataset_on_device:
            if self.experimental_fetch_to_device:
                raise ValueError(
                    "`experimental_place_dataset_on_device` cannot be combined with "
                    "`experimental_fetch_to_device=True`: a dataset placed on the device "
                    "is already there. Received: " + repr(self)
                )
            if self.experimental_replication_mode is InputReplicationMode.PER_WORKER:
                raise ValueError(
                    "`experimental_place_dataset_on_device=True` needs "
                    "`experimental_replication_mode=InputReplicationMode.PER_REPLICA`. "
                    "Received: " + repr(self)
                )
        if self.experimental_per_replica_buffer_size < 0:
            raise ValueError(
                "`experimental_per_replica_buffer_size` must be at least 0. Received: "
                f"{self.experimental_per_replica_buffer_size}"
            )


class InputContext:
    """Tells ``dataset_fn`` which input pipeline it builds and for how many replicas.

    >>> ctx = InputContext(num_input_pipelines=2, input_pipeline_id=1, num_replicas_in_sync=6)
    >>> ctx.get_per_replica_batch_size(12)
    2
    """

    def __init__(self, num_input_pipelines=1, input_pipeline_id=0, num_replicas_in_sync=1):
        self._num_input_pipelines = num_input_pipelines
        self._input_pipeline_id = input_pipeline_id
        self._num_replicas_in_sync = num_replicas_in_sync

    @property
    def num_replicas_in_sync(self) -> int:
        """The number of replicas in sync, all pipelines together."""
        return self._num_replicas_in_sync

    @property
    def input_pipeline_id(self) -> int:
        """This pipeline's index, in ``[0, num_input_pipelines)``; shard by it."""
        return self._input_pipeline_id

    @property
    def num_input_pipelines(self) -> int:
        """How many input pipelines there are (one per worker by default)."""
        return self._num_input_pipelines

    def get_per_replica_batch_size(self, global_batch_size: int) -> int:
        """``global_batch_size // num_replicas_in_sync``; it must divide evenly."""
        if global_batch_size % self._num_replicas_in_sync != 0:
            raise ValueError(
                f"The `global_batch_size` {global_batch_size} is not divisible by "
                f"`num_replicas_in_sync` {self._num_replicas_in_sync}. Choose a global "
                "batch size that is a multiple of the replica count. Received: "
                f"global_batch_size={global_batch_size}, "
                f"num_replicas_in_sync={self._num_replicas_in_sync}."
            )
        return global_batch_size // self._num_replicas_in_sync

    def __str__(self):
        return (
            f"tf.distribute.InputContext(input pipeline id {self._input_pipeline_id}, "
            f"total: {self._num_input_pipelines})"
        )

    __repr__ = __str__


def _as_array(x):
    return x if isinstance(x, jax.Array) else np.asarray(x)


class _GlobalBatchSplitter:
    """Splits one global batch (a nest of arrays) into per-replica ``PerReplica`` leaves.

    With ``on_host=True`` an evenly split NumPy batch stays on the host, stacked
    ``(replicas, rows, ...)``: the compiled step takes it as an argument and
    places it itself, which costs a third of a separate ``device_put`` on CPU
    (``fit`` uses this; a distributed dataset places batches ahead of use).

    Across processes every worker reads the same global batch and keeps its
    replicas' pieces: with ``strided`` pieces ``w, w + W, ...`` of worker ``w``
    of ``W`` (TF's rebatching followed by DATA sharding, so its values are
    TF's), otherwise its consecutive ones (replica order is batch order, which
    ``predict`` relies on).
    """

    def __init__(self, extended, on_host=False, strided=False):
        self._extended = extended
        self._on_host = on_host
        self._strided = strided

    def _mine(self, pieces):
        """This process's share of the ``num_replicas_in_sync`` pieces of a batch."""
        extended = self._extended
        if not extended._multi_process:
            return pieces
        if self._strided:
            return pieces[extended._worker_index :: extended._num_workers]
        start = extended._replica_offset
        return pieces[start : start + extended._num_local_replicas]

    def __call__(self, batch):
        leaves, treedef = jax.tree_util.tree_flatten(batch)
        leaves = [_as_array(x) for x in leaves]
        sizes = {x.shape[0] if x.ndim else None for x in leaves}
        if None in sizes or len(sizes) != 1:
            raise ValueError(
                "Every array of a global batch needs the same leading (batch) dimension "
                "to be split between replicas. Batch the dataset first. Received: "
                f"shapes={[x.shape for x in leaves]}"
            )
        (size,) = sizes
        n = self._extended._num_replicas_in_sync
        if size and size % n == 0:
            split = [self._stacked(x, n) for x in leaves]
        else:
            bounds = np.cumsum([0] + [len(a) for a in np.array_split(np.arange(size), n)])
            pieces = self._mine([(bounds[i], bounds[i + 1]) for i in range(n)])
            split = []
            for x in leaves:
                value = PerReplica(
                    tuple(
                        jax.device_put(x[start:stop], device)
                        for (start, stop), device in zip(pieces, self._extended._devices)
                    ),
                    _validate=False,
                )
                value._uneven_across_processes = self._extended._multi_process
                split.append(value)
        return jax.tree_util.tree_unflatten(treedef, split)

    def _stacked(self, x, n):
        stacked = x.reshape((n, x.shape[0] // n) + x.shape[1:])
        if self._extended._multi_process:
            rows = self._mine(list(range(n)))
            return PerReplica(
                None, _stacked=self._extended._put_local_rows(np.asarray(stacked)[rows])
            )
        if not (self._on_host and isinstance(stacked, np.ndarray)):
            stacked = jax.device_put(stacked, self._extended._split)
        return PerReplica(None, _stacked=stacked)


def _per_replica_batches(extended, batches, template=None, uneven=False):
    """One step from one batch per local replica; missing ones become empty batches.

    ``template`` gives the structure of an empty batch when no replica here has
    one; ``uneven`` marks the step as uneven across processes.
    """
    present = [b for b in batches if b is not None]
    template = jax.tree_util.tree_map(_as_array, present[0] if present else template)
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
            leaves.append(PerReplica(None, _stacked=extended._put_local_rows(stacked)))
        else:
            value = PerReplica(
                tuple(jax.device_put(c, d) for c, d in zip(column, extended._devices)),
                _validate=False,
            )
            value._uneven_across_processes = uneven
            leaves.append(value)
    return jax.tree_util.tree_unflatten(treedef, leaves)


class _AgreedSteps:
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
            batches = [None] * extended._num_local_replicas
        sizes = np.zeros(extended._num_replicas_in_sync, np.int32)
        for i, batch in enumerate(batches):
            # Rows + 1, so that an empty batch still counts as present.
            sizes[extended._replica_offset + i] = 0 if batch is None else _batch_rows(batch) + 1
        sizes = np.asarray(extended._cross_process_sum(sizes))
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
                f"{extended._worker_index}"
            )
        uneven = len(set(np.maximum(sizes - 1, 0).tolist())) > 1
        return _per_replica_batches(extended, batches, self._template, uneven)


def _batch_rows(batch) -> int:
    leaves = [x for x in jax.tree_util.tree_leaves(batch) if np.ndim(x) > 0]
    return int(np.shape(leaves[0])[0]) if leaves else 1


class _RebatchedForEveryWorker:
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
            while len(pending) < extended._num_local_replicas:
                batch = next(iterator, None)
                if batch is None:
                    break
                batch = jax.tree_util.tree_map(_as_array, batch)
                template = batch
                size = _batch_rows(batch)
                rows = rows or max(1, size // extended._num_replicas_in_sync)
                for start in range(0, size, rows):
                    pending.append(
                        jax.tree_util.tree_map(lambda x, s=start: x[s : s + rows], batch)
                    )
            if not pending:
                raise StopIteration
            step = pending[: extended._num_local_replicas]
            del pending[: extended._num_local_replicas]
            step += [None] * (extended._num_local_replicas - len(step))
            return _per_replica_batches(extended, step, template)

        return next_fn


_NOTHING = object()


class DistributedIterator:
    """Iterates a ``DistributedDataset``: each element is a nest of ``PerReplica`` values.

    Call it in cross-replica context and pass the element to ``strategy.run``.
    """

    def __init__(self, next_fn):
        self._next_fn = next_fn
        self._element_spec = None
        self._peeked = _NOTHING  # the element `element_spec` read ahead, not yet returned

    def __iter__(self):
        return self

    def __next__(self):
        replica_context = _context.current_frame().replica_context
        if replica_context is not None and not replica_context._is_default:
            # As TF: inside a replica each replica would take its own step of the
            # data (eager), or the step would be read at trace time (compiled).
            raise ValueError(
                "next(iterator) should be called from outside of replica_fn, e.g. "
                "strategy.run(replica_fn, args=(next(iterator),)). Received: a call "
                f"inside `run` of {type(replica_context.strategy).__name__}."
            )
        if self._peeked is not _NOTHING:
            value, self._peeked = self._peeked, _NOTHING
            return value
        value = self._next_fn()
        if self._element_spec is None:
            self._element_spec = _spec_of(value)
        return value

    def get_next(self):
        """The next element; raises ``StopIteration`` at the end (TF: OutOfRangeError)."""
        return next(self)

    def get_next_as_optional(self) -> "Optional":
        """The next element as an ``Optional``, empty at the end of the data."""
        try:
            return Optional(next(self))
        except StopIteration:
            return Optional(None)

    @property
    def element_spec(self):
        """The per-replica structure of the elements (``jax.ShapeDtypeStruct`` leaves).

        Known before the first ``get_next``, as in TF: the first element is read
        ahead and kept for it. ``None`` when the data is empty.
        """
        if self._element_spec is None and self._peeked is _NOTHING:
            try:
                self._peeked = next(self)
            except StopIteration:
                return None
        return self._element_spec


class Optional:
    """A value that may be missing, as ``tf.experimental.Optional``."""

    def __init__(self, value):
        self._value = value

    def has_value(self) -> bool:
        return self._value is not None

    def get_value(self):
        if self._value is None:
            raise ValueError("The Optional has no value: the iterator reached its end.")
        return self._value


class DistributedDataset:
    """A dataset whose elements are split between replicas; re-iterable per epoch.

    >>> import numpy as np, keras_dist as kd
    >>> strategy = kd.MirroredStrategy(["/cpu:0", "/cpu:1"])
    >>> batches = [np.arange(4.0)]
    >>> [x.tolist() for x in strategy.experimental_local_results(
    ...     next(iter(strategy.experimental_distribute_dataset(batches))))]
    [[0.0, 1.0], [2.0, 3.0]]
    """

    def __init__(self, make_next_fn):
        self._make_next_fn = make_next_fn
        self._element_spec = None

    @classmethod
    def from_global_batches(cls, strategy, dataset, options=None):
        if options is not None:
            options.validate()
            if options.experimental_replication_mode is InputReplicationMode.PER_REPLICA:
                # As TF: a global batch has no per-replica pipelines to build.
                raise NotImplementedError(
                    "InputReplicationMode.PER_REPLICA is only supported in "
                    "`distribute_datasets_from_function`. Received: " + repr(options)
                )
        _check_iterable(dataset)
        extended = strategy.extended
        if not hasattr(extended, "_split"):
            return cls(lambda: iter(dataset).__next__)
        if extended._multi_process and _policy_is_off(dataset):
            rebatched = _RebatchedForEveryWorker(extended, dataset)
            return cls(lambda: _ahead(rebatched(), options))
        splitter = _GlobalBatchSplitter(extended, strided=True)

        def make_next_fn():
            iterator = iter(dataset)
            return _ahead(lambda: splitter(next(iterator)), options)

        return cls(make_next_fn)

    @classmethod
    def from_function(cls, strategy, dataset_fn, options=None):
        options = options or InputOptions()
        options.validate()
        extended = strategy.extended
        n = strategy.num_replicas_in_sync
        per_replica = options.experimental_replication_mode is InputReplicationMode.PER_REPLICA
        if not hasattr(extended, "_split"):
            dataset = dataset_fn(InputContext(1, 0, n))
            _check_iterable(dataset)
            return cls(lambda: iter(dataset).__next__)
        local = range(
            extended._replica_offset, extended._replica_offset + extended._num_local_replicas
        )
        if per_replica:
            datasets = [dataset_fn(InputContext(n, i, n)) for i in local]
        else:
            context = InputContext(extended._num_workers, extended._worker_index, n)
            datasets = [dataset_fn(context)]
        for dataset in datasets:
            _check_iterable(dataset)

        def make_next_fn():
            iterators = [iter(d) for d in datasets]

            def read_local():
                batches = []
                for i in range(len(local)):
                    iterator = iterators[i] if per_replica else iterators[0]
                    batches.append(next(iterator, None))
                if all(b is None for b in batches):
                    raise StopIteration
                return batches

            if extended._multi_process:
                # Local reads run ahead; the step is agreed on the caller's thread.
                return _AgreedSteps(extended, _ahead(read_local, options))

            def next_fn():
                return _per_replica_batches(extended, read_local())

            return _ahead(next_fn, options)

        return cls(make_next_fn)

    def __iter__(self) -> DistributedIterator:
        return DistributedIterator(self._make_next_fn())

    @property
    def element_spec(self):
        """The per-replica structure of the elements, read from the first element."""
        if self._element_spec is None:
            self._element_spec = _spec_of(next(iter(self)))
        return self._element_spec


def _ahead(next_fn, options):
    """``next_fn`` run ahead on a thread (batches split and sent to the devices early).

    ``InputOptions(experimental_fetch_to_device=False)`` turns it off; the buffer
    holds ``experimental_per_replica_buffer_size`` steps (at least one).
    """
    if options is not None and options.experimental_fetch_to_device is False:
        return next_fn
    size = max(1, options.experimental_per_replica_buffer_size if options else 1)
    return Prefetch(_calls(next_fn), buffer_size=size).__next__


def _policy_is_off(dataset) -> bool:
    from keras_dist.data import AutoShardPolicy

    return getattr(dataset, "auto_shard_policy", None) is AutoShardPolicy.OFF


def _calls(next_fn):
    while True:
        try:
            yield next_fn()
        except StopIteration:
            return


def _spec_of(value):
    def spec(x):
        if isinstance(x, PerReplica):
            x = x.values[0]
        return jax.ShapeDtypeStruct(np.shape(x), x.dtype)

    return jax.tree_util.tree_map(spec, value, is_leaf=lambda x: isinstance(x, PerReplica))


def _check_iterable(dataset):
    if iter(dataset) is dataset:
        raise ValueError(
            "A distributed dataset must be re-iterable (a list, a NumPy dataset, a "
            "Grain dataset, a `keras.utils.PyDataset`...), not a one-shot iterator, "
            "so that each epoch starts again. Received: " + type(dataset).__name__
        )


class NumpyDataset:
    """The rows of a nest of NumPy arrays; ``batch(n)`` makes global batches.

    >>> ds = NumpyDataset(np.arange(5)).batch(2)
    >>> [b.tolist() for b in ds]
    [[0, 1], [2, 3], [4]]
    """

    def __init__(self, numpy_input, batch_size=None, drop_remainder=False):
        self._data = jax.tree_util.tree_map(np.asarray, numpy_input)
        leaves = jax.tree_util.tree_leaves(self._data)
        self._size = len(leaves[0]) if leaves else 0
        self._batch_size = batch_size
        self._drop_remainder = drop_remainder

    def batch(self, batch_size: int, drop_remainder: bool = False) -> "NumpyDataset":
        """Groups rows into batches of ``batch_size`` (the last may be smaller)."""
        return NumpyDataset(self._data, batch_size, drop_remainder)

    def __len__(self):
        if self._batch_size is None:
            return self._size
        full, rest = divmod(self._size, self._batch_size)
        return full + (1 if rest and not self._drop_remainder else 0)

    def __iter__(self):
        step = self._batch_size or 1
        for start in range(0, len(self) * step, step):
            if self._batch_size is None:
                yield jax.tree_util.tree_map(lambda x, s=start: x[s], self._data)
            else:
                yield jax.tree_util.tree_map(lambda x, s=start: x[s : s + step], self._data)
