"""Datasets a ``ParameterServerStrategy`` distributes: built on the workers, not here.

``strategy.distribute_datasets_from_function(fn)`` and
``experimental_distribute_dataset(ds)`` return a ``DirectDataset``: pass it (or
a function returning it) to ``ClusterCoordinator.create_per_worker_dataset``.
Iterating it on the coordinator raises, as TF's does.
"""

import inspect
import threading

import jax
import keras
import numpy as np

from keras_dist import _context
from keras_dist._capabilities import MeshRuntime
from keras_dist._capabilities import RemoteScheduling
from keras_dist._input import InputContext
from keras_dist._input._host_arrays import to_host_arrays


def _takes_context(dataset_fn) -> bool:
    """Whether ``dataset_fn`` takes an ``InputContext`` (else nothing)."""
    try:
        return bool(inspect.signature(dataset_fn).parameters)
    except (TypeError, ValueError):  # a builtin without a signature
        return True


class DirectDataset:
    """A dataset for the workers of a parameter-server cluster; ``iter()`` here raises."""

    def __init__(self, dataset_fn):
        self.dataset_fn = dataset_fn

    def dataset_for(self, input_context: "InputContext | None" = None):
        """The underlying dataset, built for ``input_context`` (on a worker)."""
        context = input_context or InputContext()
        return self.dataset_fn(context) if _takes_context(self.dataset_fn) else self.dataset_fn()

    def __iter__(self):
        raise ValueError(
            "This dataset was distributed by a ParameterServerStrategy: its elements are "
            "read on the workers. Pass it to `ClusterCoordinator.create_per_worker_dataset` "
            "and call `next()` on the per-worker iterator inside a scheduled function. "
            f"Received: iter() of {self!r} on the coordinator"
        )


class DatasetCreator(keras.utils.PyDataset):
    """A dataset built by ``dataset_fn(InputContext)`` on every worker, for ``model.fit``.

    TF's ``tf.keras.utils.experimental.DatasetCreator``: with
    ``ParameterServerStrategy``, each worker builds its own pipeline and its
    steps read from it; the coordinator reads no data. The dataset is infinite
    as far as Keras knows: pass ``steps_per_epoch`` (and ``validation_steps``).

    Args:
        dataset_fn: a function of an ``InputContext`` (or of nothing) returning
            an iterable of batches ``(x, y)`` or ``(x, y, sample_weight)``.
        input_options: accepted for TF compatibility.

    >>> import numpy as np
    >>> creator = DatasetCreator(lambda context: [(np.ones((2, 1)), np.ones((2, 1)))])
    >>> creator.num_batches is None
    True
    """

    # Built on the workers, endless to Keras: its loops need their steps (TF's rule).
    keras_dist_needs_steps = True

    def __init__(self, dataset_fn, input_options=None):
        super().__init__()
        if not callable(dataset_fn):
            raise TypeError(
                "`DatasetCreator` needs a function that builds the dataset "
                f"(`dataset_fn(input_context)`). Received: dataset_fn={dataset_fn!r}"
            )
        self.dataset_fn = dataset_fn
        self.input_options = input_options
        self._tokens = None
        self._local = None  # (context, iterator) when this process reads the batches
        self._last = None  # (index, batch): what the last ``__getitem__`` returned
        # Keras may read an epoch's batches while the last epoch's reader still
        # runs (both in threads): one ``next`` on the pipeline at a time.
        self._reading = threading.Lock()

    def __call__(self, *args, **kwargs):
        return self.dataset_fn(*args, **kwargs)

    def __getstate__(self):
        # A copy (Keras's multiprocessing readers) starts its own pipeline.
        state = dict(self.__dict__, _local=None, _last=None)
        state.pop("_reading")
        return state

    def __setstate__(self, state):
        self.__dict__.update(state, _reading=threading.Lock())

    @property
    def num_batches(self):
        return None  # built on the workers; Keras needs steps_per_epoch

    def __getitem__(self, index):
        strategy = _context.get_strategy()
        extended = strategy.extended
        if not (isinstance(extended, RemoteScheduling) and extended.schedules_on_workers):
            return self._batch_at(index, strategy)
        # Keras reads this on the coordinator: tokens shaped like a batch (Keras
        # builds its metrics from their shapes) saying "read on the worker".
        if self._tokens is None:
            context = InputContext()
            dataset = (
                self.dataset_fn(context) if _takes_context(self.dataset_fn) else (self.dataset_fn())
            )
            element = next(iter(dataset))
            tokens = jax.tree_util.tree_map(lambda leaf: FromWorkers(self, leaf), element)
            self._tokens = tuple(tokens) if isinstance(tokens, (tuple, list)) else (tokens,)
        return self._tokens

    def _batch_at(self, index, strategy):
        """The batch for ``index``: Keras asks for index 0 twice (a peek, then the read)."""
        last = self._last
        if last is not None and last[0] == index:
            return last[1]
        batch = self._next_local_batch(strategy)
        self._last = (index, batch)
        return batch

    def _next_local_batch(self, strategy):
        """Under other strategies this process reads the pipeline itself, across epochs (TF's).

        As TF's ``distribute_datasets_from_function``, the function builds one
        pipeline per worker (``InputContext(num_workers, worker_index,
        replicas)``) whose elements are per-replica batches: each of this
        worker's replicas takes one, so the global batch is
        ``get_per_replica_batch_size(global) * num_replicas_in_sync`` rows.
        Across processes the workers' rows are gathered into that global batch
        (every worker's ``fit`` steps on the same one, each replica on its own rows).
        """
        with self._reading:
            pieces = [self._next_element(strategy) for _ in range(_local_replicas(strategy))]
        return _global_batch(strategy.extended, pieces)

    def to_the_end(self) -> "_OnePass":
        """This process's batches of one pass of its pipeline, to its end: what ``fit``,
        ``evaluate`` and ``predict`` read with ``steps=-1`` (TF's "until the data is
        exhausted"). Each ``iter()`` builds the pipeline again (the next epoch's).

        >>> import numpy as np
        >>> creator = DatasetCreator(lambda context: [(np.ones((2, 1)),)] * 3)
        >>> len(list(creator.to_the_end()))
        3
        """
        return _OnePass(self._one_pass)

    def _one_pass(self):
        strategy = _context.get_strategy()
        extended = strategy.extended
        if isinstance(extended, MeshRuntime) and extended.spans_processes:
            # Each worker's pipeline may end at another step: a step would wait for
            # workers that have ended.
            raise ValueError(
                "A `DatasetCreator` read to its end (`steps=-1`) across processes could "
                "end at a different step on each worker: pass the number of steps "
                f"(`steps_per_epoch`, `steps`). Received: steps=-1 on worker "
                f"{extended.worker_index} of {extended.num_workers}"
            )
        iterator = iter(self._build(_input_context(strategy)))
        replicas = _local_replicas(strategy)
        while True:
            # As TF's static-shape rule: the input ends at the first step some replica
            # has no element for.
            pieces = [next(iterator, None) for _ in range(replicas)]
            if any(piece is None for piece in pieces):
                return
            yield _global_batch(extended, pieces)

    def _next_element(self, strategy):
        if self._local is None:
            context = _input_context(strategy)
            self._local = (context, iter(self._build(context)))
        context, iterator = self._local
        try:
            return next(iterator)
        except StopIteration:  # a finite pipeline: start it again
            self._local = (context, iter(self._build(context)))
            return next(self._local[1])

    def _build(self, context):
        return self.dataset_fn(context) if _takes_context(self.dataset_fn) else self.dataset_fn()


class _OnePass:
    """A ``DatasetCreator``'s pipeline read once to its end, again at each ``iter()``."""

    def __init__(self, one_pass):
        self._one_pass = one_pass

    def __iter__(self):
        return self._one_pass()


def _input_context(strategy) -> InputContext:
    extended = strategy.extended
    return InputContext(extended.num_workers, extended.worker_index, strategy.num_replicas_in_sync)


def _local_replicas(strategy) -> int:
    extended = strategy.extended
    return extended.num_local_replicas if isinstance(extended, MeshRuntime) else 1


def _global_batch(extended, pieces):
    """This worker's replicas' elements as one global batch (the one element itself where
    it is the whole batch); TensorFlow values (a tf.data pipeline's) as NumPy: Keras takes
    a bare array as ``(x,)``, not a bare ``tf.Tensor``."""
    pieces = [to_host_arrays(piece) for piece in pieces]
    spans = isinstance(extended, MeshRuntime) and extended.spans_processes
    if len(pieces) == 1 and not spans:
        return pieces[0]
    return jax.tree_util.tree_map(lambda *leaves: _global_rows(extended, leaves), *pieces)


def _global_rows(extended, leaves):
    """This worker's replicas' batches as rows of the global batch (gathered across processes)."""
    shapes = {np.shape(leaf) for leaf in leaves}
    if len(shapes) != 1:
        raise ValueError(
            "The batches a `DatasetCreator`'s pipeline gives this worker's replicas must have "
            "one shape (batch with `drop_remainder=True`, or give every batch the same size). "
            f"Received: shapes={sorted(shapes)}"
        )
    stacked = np.stack([np.asarray(leaf) for leaf in leaves])
    if extended.spans_processes:
        placement = extended.placement
        stacked = np.asarray(placement.all_rows(placement.put_local_rows(stacked)))
    return stacked.reshape((-1,) + stacked.shape[2:])


class FromWorkers:
    """A leaf of what a ``DatasetCreator`` hands Keras's loop: read on a worker.

    It has the ``shape`` and ``dtype`` of the batch the worker will read.
    """

    def __init__(self, creator: DatasetCreator, leaf):
        self.creator = creator
        array = np.asarray(leaf)
        self.shape = array.shape
        self.dtype = array.dtype
