"""Distributed datasets: what ``experimental_distribute_dataset`` and
``distribute_datasets_from_function`` return, and their iterators.

``experimental_distribute_dataset`` takes any re-iterable of *global* batches
(nests of NumPy or JAX arrays) and splits each between the local replicas
(``_split``). ``distribute_datasets_from_function`` calls
``dataset_fn(InputContext)`` and gives each replica its own batches in turn.
Batches are read, split and sent to the devices ahead of use (``Prefetch``).
"""

import collections.abc

import jax
import keras
import numpy as np

from keras_dist import errors
from keras_dist._capabilities import MeshRuntime
from keras_dist._context import current_function_trace
from keras_dist._context import refuse_input_read_in_trace
from keras_dist._context import running_replica_context
from keras_dist._input._host_arrays import to_host_arrays
from keras_dist._input._options import InputContext
from keras_dist._input._options import InputOptions
from keras_dist._input._options import InputReplicationMode
from keras_dist._input._options import checked_input_options
from keras_dist._input._prefetch import Prefetch
from keras_dist._input._split import AgreedSteps
from keras_dist._input._split import GlobalBatchSplitter
from keras_dist._input._split import RebatchedForEveryWorker
from keras_dist._input._split import per_replica_batches
from keras_dist._input._static_shapes import statically_shaped
from keras_dist._jax_trace import refuse_foreign_trace
from keras_dist._values import DistributedValues
from keras_dist._values import PerReplica
from keras_dist.data import AutoShardPolicy
from keras_dist.data._sharding import policy_of

_NOTHING = object()


class EndOfInput(errors.OutOfRangeError, StopIteration):
    """``get_next()`` past the last element: TF's ``OutOfRangeError``, and a ``StopIteration``.

    >>> issubclass(EndOfInput, StopIteration)
    True
    """


class DistributedIterator:
    """Iterates a ``DistributedDataset``: each element is a nest of ``PerReplica`` values
    (with one replica in sync, of the batches themselves, as in TF).

    Call it in cross-replica context and pass the element to ``strategy.run``.

    >>> import numpy as np, keras_dist as kd
    >>> strategy = kd.MirroredStrategy(["/cpu:0", "/cpu:1"])
    >>> dataset = strategy.experimental_distribute_dataset([np.arange(4.0), np.arange(2.0)])
    >>> iterator = iter(dataset)
    >>> [v.tolist() for v in strategy.experimental_local_results(next(iterator))]
    [[0.0, 1.0], [2.0, 3.0]]
    >>> [v.tolist() for v in strategy.experimental_local_results(iterator.get_next())]
    [[0.0], [1.0]]
    >>> iterator.get_next_as_optional().has_value()
    False
    """

    def __init__(self, next_fn):
        self._next_fn = next_fn
        self._element_spec = None
        # Elements read ahead and not yet returned, the next one last (``element_spec``
        # reads one; a ``kd.function`` puts back those it read for a call run as Python).
        self._put_back: list = []

    def __iter__(self):
        return self

    def __next__(self):
        replica_context = running_replica_context()
        if replica_context is not None:
            # As TF: inside a replica each replica would take its own step of the
            # data (eager), or the step would be read at trace time (compiled).
            raise ValueError(
                "next(iterator) should be called from outside of replica_fn, e.g. "
                "strategy.run(replica_fn, args=(next(iterator),)). Received: a call "
                f"inside `run` of {type(replica_context.strategy).__name__}."
            )
        if current_function_trace() is None:
            refuse_foreign_trace("`next(iterator)`")
        refuse_input_read_in_trace()
        if self._put_back:
            return self._put_back.pop()
        value = self._next_fn()
        if self._element_spec is None:
            self._element_spec = _spec_of(value)
        return value

    def get_next(self):
        """The next element; past the last one raises ``kd.errors.OutOfRangeError``, as TF.

        (The error is a ``StopIteration`` too.)
        """
        try:
            return next(self)
        except StopIteration:
            raise EndOfInput(
                "End of sequence: the distributed iterator has no more elements. Use "
                "`get_next_as_optional()` to test for the end, or iterate the dataset "
                "again for the next epoch. Received: get_next() after the last element"
            ) from None

    def put_back(self, element) -> None:
        """Makes ``element`` the next one again (a ``kd.function`` that read it ahead for a
        call, then ran that call as Python). Put several back last one first."""
        self._put_back.append(element)

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
        if self._element_spec is None and not self._put_back:
            try:
                self._put_back.append(next(self))
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

    def __init__(self, make_next_fn, global_batches=None, join_replicas=False, sources=None):
        self._make_next_fn = make_next_fn
        self._element_spec = None
        # What Keras's loops read instead (see ``global_batches``); None: they cannot.
        self._global_batches = JoinedReplicas(self) if join_replicas else global_batches
        self._sources = tuple(sources) if sources is not None else (global_batches,)

    @property
    def sources(self) -> tuple:
        """The datasets this one reads: the dataset of global batches, or the pipelines
        ``dataset_fn`` built (whether they end is read from them)."""
        return self._sources

    def global_batches(self):
        """The global batches this dataset splits, for ``fit``, ``evaluate`` and ``predict``.

        TF's Keras takes a distributed dataset there; its loops split the global
        batches themselves. A dataset made from one is that dataset; one made by
        ``distribute_datasets_from_function`` gives each element's per-replica
        batches joined, in replica order.

        >>> import numpy as np, keras_dist as kd
        >>> strategy = kd.MirroredStrategy(["/cpu:0", "/cpu:1"])
        >>> dataset = strategy.distribute_datasets_from_function(
        ...     lambda context: [np.arange(2.0), np.arange(2.0, 4.0)])  # one batch a replica
        >>> [batch.tolist() for batch in dataset.global_batches()]
        [[0.0, 1.0, 2.0, 3.0]]
        """
        if self._global_batches is None:
            raise ValueError(
                "`fit`, `evaluate` and `predict` of a multi-worker strategy read global "
                "batches that every worker splits; a dataset of "
                "`distribute_datasets_from_function` gives each worker its own. Pass "
                "`kd.experimental.DatasetCreator(dataset_fn)` instead (each worker reads its "
                "pipeline, TF's way), or the dataset of global batches itself. Received: "
                f"{self!r}"
            )
        return self._global_batches

    @classmethod
    def from_global_batches(cls, strategy, dataset, options=None):
        options = checked_input_options(options, "experimental_distribute_dataset")
        if options is not None:
            options.validate(dataset_fn=False)
            if options.experimental_replication_mode is InputReplicationMode.PER_REPLICA:
                # As TF: a global batch has no per-replica pipelines to build.
                raise NotImplementedError(
                    "InputReplicationMode.PER_REPLICA is only supported in "
                    "`distribute_datasets_from_function`. Received: " + repr(options)
                )
        _check_not_arrays(dataset)
        _check_iterable(dataset)
        extended = strategy.extended
        if not isinstance(extended, MeshRuntime):
            # No mesh: batches go to the one replica as they are, as host arrays.
            return cls(lambda: _host_passes(dataset).__next__, dataset)
        if extended.spans_processes and policy_of(dataset) is AutoShardPolicy.FILE:
            raise ValueError(
                "AutoShardPolicy.FILE gives each worker its own files, in the pipelines of "
                "`distribute_datasets_from_function`: build the dataset in a "
                "`dataset_fn(input_context)` and apply the policy there with "
                "`kd.data.auto_shard(dataset, input_context)`, then batch it. "
                "`experimental_distribute_dataset` splits the same global batches on every "
                "worker (DATA or OFF). Received: a dataset with AutoShardPolicy.FILE"
            )
        if extended.spans_processes and _policy_is_off(dataset):
            rebatched = RebatchedForEveryWorker(extended, dataset)
            return cls(lambda: _ahead(rebatched(), options), dataset)
        splitter = GlobalBatchSplitter(extended, strided=True)
        whole = _whole_for_one_replica(strategy)
        split = lambda batch: whole(splitter(batch))  # noqa: E731
        if strategy.num_replicas_in_sync == 1 and not extended.spans_processes:
            split = splitter.whole  # (not stacked for a mesh, then taken apart again)

        def make_next_fn():
            iterator = _passes(dataset)
            return _ahead(lambda: split(next(iterator)), options)

        return cls(make_next_fn, dataset)

    @classmethod
    def from_function(cls, strategy, dataset_fn, options=None):
        options = checked_input_options(options, "distribute_datasets_from_function")
        options = options or InputOptions()
        options.validate()
        extended = strategy.extended
        n = strategy.num_replicas_in_sync
        per_replica = options.experimental_replication_mode is InputReplicationMode.PER_REPLICA
        if not isinstance(extended, MeshRuntime):
            dataset = dataset_fn(InputContext(1, 0, n))
            _check_iterable(dataset)
            return cls(lambda: _host_passes(dataset).__next__, dataset)
        first = extended.first_local_replica_id
        local = range(first, first + extended.num_local_replicas)
        if per_replica:
            datasets = [dataset_fn(InputContext(n, i, n)) for i in local]
        else:
            context = InputContext(extended.num_workers, extended.worker_index, n)
            datasets = [dataset_fn(context)]
        for dataset in datasets:
            _check_iterable(dataset)
        # TF: static element shapes on one worker turn partial-batch handling off.
        ends_at_first_gap = not extended.spans_processes and all(
            statically_shaped(d) for d in datasets
        )

        def make_next_fn():
            iterators = [_passes(d) for d in datasets]

            def read_local():
                batches = []
                for i in range(len(local)):
                    iterator = iterators[i] if per_replica else iterators[0]
                    batches.append(next(iterator, None))
                if all(b is None for b in batches):
                    raise StopIteration
                if ends_at_first_gap and any(b is None for b in batches):
                    raise StopIteration
                return batches

            if extended.spans_processes:
                # Local reads run ahead; the step is agreed on the caller's thread.
                return AgreedSteps(extended, _ahead(read_local, options))

            whole = _whole_for_one_replica(strategy)

            def next_fn():
                return whole(per_replica_batches(extended, read_local()))

            return _ahead(next_fn, options)

        return cls(make_next_fn, join_replicas=not extended.spans_processes, sources=datasets)

    def __iter__(self) -> DistributedIterator:
        refuse_input_read_in_trace()
        return DistributedIterator(self._make_next_fn())

    @property
    def element_spec(self):
        """The per-replica structure of the elements, read from the first element.

        ``None`` when the data is empty (as the iterator's).
        """
        if self._element_spec is None:
            first = next(iter(self), _NOTHING)
            if first is _NOTHING:
                return None
            self._element_spec = _spec_of(first)
        return self._element_spec


class JoinedReplicas:
    """Each element of a distributed dataset as one global batch: its replicas' batches
    joined on the host, in replica order (re-iterable)."""

    def __init__(self, distributed):
        self._distributed = distributed

    def __iter__(self):
        for element in self._distributed:
            yield jax.tree_util.tree_map(
                _joined, element, is_leaf=lambda v: isinstance(v, DistributedValues)
            )


def _joined(value):
    if not isinstance(value, DistributedValues):
        return np.asarray(value)
    return np.concatenate([np.asarray(component) for component in value.values])


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
    return policy_of(dataset) is AutoShardPolicy.OFF


def _calls(next_fn):
    while True:
        try:
            yield next_fn()
        except StopIteration:
            return


def _passes(dataset):
    """An iterator over one pass of ``dataset``; a ``keras.utils.PyDataset`` has its
    ``on_epoch_end`` called after a whole pass, as ``fit`` calls it (its reshuffle)."""
    iterator = iter(dataset)
    if not isinstance(dataset, keras.utils.PyDataset):
        return iterator

    def one_pass():
        yield from iterator
        dataset.on_epoch_end()

    return one_pass()


def _host_passes(dataset):
    """One pass of ``dataset`` with TensorFlow values as NumPy arrays, which the mesh
    strategies' split makes of them too (a ``tf.data`` batch on the default strategy)."""
    return map(to_host_arrays, _passes(dataset))


def _whole_for_one_replica(strategy):
    """What makes a step's element as TF gives it: with one replica in sync, the batch
    itself (``x.shape``, ``x * 2`` and ``float(x)`` work on it), not a ``PerReplica``."""
    if strategy.num_replicas_in_sync != 1:
        return lambda element: element

    def whole(element):
        return jax.tree_util.tree_map(
            lambda x: x.values[0] if isinstance(x, PerReplica) else x,
            element,
            is_leaf=lambda x: isinstance(x, PerReplica),
        )

    return whole


def _spec_of(value):
    def spec(x):
        if isinstance(x, PerReplica):
            x = x.values[0]
        # A leaf given as it is (the default strategy's) may be a Python number.
        dtype = x.dtype if isinstance(x, (np.ndarray, jax.Array)) else np.asarray(x).dtype
        return jax.ShapeDtypeStruct(np.shape(x), dtype)

    return jax.tree_util.tree_map(spec, value, is_leaf=lambda x: isinstance(x, PerReplica))


def _check_not_arrays(dataset):
    arrays = isinstance(dataset, (tuple, dict)) and all(
        _is_array(x) for x in (dataset.values() if isinstance(dataset, dict) else dataset)
    )
    if _is_array(dataset) or (arrays and dataset):
        # Read as batches, an array's rows would each be split between the replicas,
        # and `(x, y)` would be two batches. TF refuses them too.
        raise TypeError(
            "A distributed dataset takes an iterable of global batches, not the arrays "
            "themselves. For arrays, batch their rows first: "
            "`strategy.experimental_make_numpy_dataset((x, y)).batch(global_batch_size)`, "
            "or pass a list of batches. Received: " + _describe_arrays(dataset)
        )


def _check_iterable(dataset):
    if callable(dataset) and not hasattr(dataset, "__iter__"):
        raise TypeError(
            "A distributed dataset takes the data, not a function making it. For what "
            "`tf.data.Dataset.from_generator(gen)` read, pass an object whose `__iter__` "
            "calls `gen()` (re-iterable, one pass per epoch), or a list of batches. "
            f"Received: {dataset!r}"
        )
    if isinstance(dataset, collections.abc.Iterator):  # not iter(): a source may count epochs
        raise ValueError(
            "A distributed dataset must be re-iterable (a list, a NumPy dataset, a "
            "Grain dataset, a `keras.utils.PyDataset`...), not a one-shot iterator, "
            "so that each epoch starts again. Received: " + type(dataset).__name__
        )


def _is_array(value) -> bool:
    return isinstance(value, (np.ndarray, jax.Array))


def _describe_arrays(value) -> str:
    if _is_array(value):
        return f"an array of shape {tuple(value.shape)}"
    shapes = jax.tree_util.tree_map(lambda x: tuple(x.shape), value)
    return f"a {type(value).__name__} of arrays of shapes {shapes}"
