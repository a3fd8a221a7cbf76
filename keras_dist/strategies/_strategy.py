"""`Strategy`: the public face every strategy shares.

A strategy describes *what* (devices, variable policy, reductions); its
``extended`` object (the contract in ``_extended``) and the engines do *how*.
Methods check the context they are called in and fail early with the fix in
the message.
"""

import contextlib
import operator
import warnings

import jax
import numpy as np

from keras_dist import _context
from keras_dist._capabilities import DistributionStrategy
from keras_dist._capabilities import MeshRuntime
from keras_dist._context import running_replica_context
from keras_dist._engine._tensorflow_calls import explains_tensorflow_calls
from keras_dist._engine_contract import ReplicaCopies
from keras_dist._input import DistributedDataset
from keras_dist._input import NumpyDataset
from keras_dist._input._host_arrays import is_tensorflow_value
from keras_dist._input._host_arrays import to_host_array
from keras_dist._input._host_arrays import to_host_arrays
from keras_dist._input._host_arrays import warn_if_int64_narrowed
from keras_dist._reduce_op import ReduceOp
from keras_dist._values import DistributedValues
from keras_dist._values import PerReplica
from keras_dist._values._local_results import LocalResults
from keras_dist._values._variables import MirroredVariable
from keras_dist._values._variables import SyncOnReadVariable
from keras_dist.strategies._extended import StrategyExtended
from keras_dist.strategies._extended import require_cross_replica


class Strategy(DistributionStrategy):
    """A way to run computation on several devices; the base of every strategy.

    Use ``scope()`` to create variables that the strategy distributes,
    ``run(fn)`` to run ``fn`` on every replica, and ``reduce`` to combine what
    the replicas returned.

    >>> import keras_dist as kd
    >>> strategy = kd.MirroredStrategy(["/cpu:0", "/cpu:1"])
    >>> per_replica = strategy.run(lambda: kd.get_replica_context().replica_id_in_sync_group)
    >>> int(strategy.reduce("SUM", per_replica, axis=None))
    1
    """

    def __init__(self, extended: "StrategyExtended"):
        self._extended = extended

    @property
    def extended(self) -> "StrategyExtended":
        """Less common methods and properties of the strategy."""
        return self._extended

    @property
    def num_replicas_in_sync(self) -> int:
        """How many replicas take part in each step."""
        return self._extended.num_replicas_in_sync

    @property
    def cluster_resolver(self):
        """The cluster resolver of a multi-worker strategy; ``None`` on one host."""
        return None

    def scope(self):
        """Makes this strategy current: variables created inside are distributed.

        Nesting the same strategy's scope is allowed; nesting another's raises.
        Call in cross-replica context.

        >>> import keras, keras_dist as kd
        >>> strategy = kd.OneDeviceStrategy("/cpu:0")
        >>> with strategy.scope():
        ...     kd.get_strategy() is strategy
        True
        """
        return _Scope(self)

    @explains_tensorflow_calls("`strategy.run`")
    def run(self, fn, args=(), kwargs=None, options=None):
        """Runs ``fn(*args, **kwargs)`` on every replica; returns ``PerReplica`` results.

        ``PerReplica`` arguments give each replica its own component; other
        arrays are the same on every replica. By default ``fn`` is traced once
        per input signature and compiled (see ``keras_dist.config``); Python
        scalars and other non-array arguments are constants of the trace.
        Call in cross-replica context.
        """
        if not isinstance(args, (list, tuple)):
            # TF's rule: ``args=x`` would otherwise become fn(x) or fn(*x) by accident.
            raise ValueError(
                "positional args must be a list or tuple: `strategy.run(fn, args=(x,))` "
                "calls fn(x), `args=()` calls fn(). Received: args="
                f"{args!r} of type {type(args).__name__}"
            )
        args, kwargs = _without_tensorflow_values((args, kwargs or {}))
        return self._extended.call_for_each_replica(fn, args, kwargs)

    def reduce(self, reduce_op, value, axis=None):
        """Reduces ``value`` across replicas (and along ``axis`` when given) to one tensor.

        ``axis=None`` combines the replicas' values; with an axis, each replica's
        value is first reduced along it (``MEAN`` counts every element once, so
        uneven batches average correctly). Call in cross-replica context.

        >>> import keras_dist as kd
        >>> strategy = kd.MirroredStrategy(["/cpu:0", "/cpu:1"])
        >>> float(strategy.reduce("MEAN", kd.PerReplica((1.0, 3.0)), axis=None))
        2.0

        A nest of values (``run``'s results as they come) is reduced element by
        element, with ``axis=None``:

        >>> pair = (kd.PerReplica((1.0, 3.0)), kd.PerReplica((1.0, 1.0)))
        >>> total, count = strategy.reduce("SUM", pair, axis=None)
        >>> float(total), float(count)
        (4.0, 2.0)
        """
        reduce_op = ReduceOp.from_value(reduce_op)
        require_cross_replica("reduce")
        value = _without_tensorflow_values(value)
        value = self._variable_as_per_replica(value)
        if _is_nest(value) and _is_nest_of_distributed(value):
            # ``run``'s results as they come (a tuple or dict of per-replica values):
            # TF reduces each element.
            if axis is not None:
                raise ValueError(
                    "`strategy.reduce` with an axis takes one distributed value, not a "
                    f"nest of them; reduce each element, e.g. [strategy.reduce(op, v, "
                    f"axis={axis!r}) for v in values]. Received: a {type(value).__name__}"
                )
            return _map_whole(lambda v: self._extended.reduce_value(reduce_op, v, None), value)
        if axis is not None:
            axis = _checked_axis("reduce", value, axis)
            _check_alike_but_along("reduce", value, axis)
        return self._extended.reduce_value(reduce_op, value, axis)

    def _variable_as_per_replica(self, value):
        """A distributed variable reduced as TF reduces it: its per-replica values
        (a SyncOnRead variable's components; a mirrored one's copies), where they are all
        here and stored (not in a trace, not split over workers)."""
        if not isinstance(value, (MirroredVariable, SyncOnReadVariable)):
            return value
        extended = self._extended
        if value.scope_value() is not None or _context.current_function_trace() is not None:
            return value
        if extended.num_replicas_in_sync == 1:
            return value
        if isinstance(extended, MeshRuntime) and extended.spans_processes:
            return value
        return PerReplica(_variable_copies(value, extended.num_replicas_in_sync))

    def experimental_local_results(self, value) -> tuple:
        """The components of ``value`` on this process's replicas, as a tuple.

        A non-distributed value gives ``(value,)``; a distributed variable its
        copies (mirrored) or components (SyncOnRead), as arrays. Callable in
        any context.
        """
        if isinstance(value, DistributedValues):
            extended = self._extended
            traced = _context.current_function_trace() is not None
            if traced and isinstance(extended, MeshRuntime) and extended.spans_processes:
                # One program for every worker: it keeps every replica's component,
                # and the function hands back this worker's (``LocalResults``).
                return LocalResults(
                    value.values, extended.first_local_replica_id, extended.num_local_replicas
                )
            return value.values
        if isinstance(value, (MirroredVariable, SyncOnReadVariable)):
            return _variable_copies(value, self._extended.num_local_replicas)
        if _is_nest_of_distributed(value):
            n = self._extended.num_local_replicas
            return tuple(
                _map_whole(
                    lambda v, i=i: v.values[i] if isinstance(v, DistributedValues) else v, value
                )
                for i in range(n)
            )
        return (value,)

    def gather(self, value, axis: int):
        """Concatenates the replicas' components of ``value`` along ``axis``.

        Call in cross-replica context; in a replica use ``ReplicaContext.all_gather``.
        """
        require_cross_replica("gather")
        value = _without_tensorflow_values(value)
        if _is_nest(value) and _is_nest_of_distributed(value):
            # ``run``'s results as they come (a tuple or dict of per-replica values):
            # each element gathered, as ``reduce`` does and TF's ``all_gather``.
            return _map_whole(lambda v: self.gather(v, axis), value)
        axis = _checked_axis("gather", value, axis)
        _check_alike_but_along("gather", value, axis)
        return self._extended.gather_value(value, axis)

    def experimental_distribute_values_from_function(self, value_fn):
        """Builds a ``PerReplica`` from ``value_fn(ValueContext)`` called once per replica.

        >>> import keras_dist as kd
        >>> strategy = kd.MirroredStrategy(["/cpu:0", "/cpu:1"])
        >>> v = strategy.experimental_distribute_values_from_function(
        ...     lambda ctx: ctx.replica_id_in_sync_group * 10.0)
        >>> [float(x) for x in strategy.experimental_local_results(v)]
        [0.0, 10.0]
        """
        return self._extended.distribute_values_from_function(
            lambda context: to_host_arrays(value_fn(context))
        )

    def experimental_distribute_dataset(self, dataset, options=None):
        """Splits each global batch of ``dataset`` between the replicas.

        ``dataset`` is any re-iterable of global batches (nests of arrays). A
        last partial batch is split as TF splits it (``ceil(rows / replicas)`` rows
        per replica, in replica order: 10 rows on 4 replicas give 3, 3, 3, 1); some replicas may
        get empty batches, as in TF.
        """
        return DistributedDataset.from_global_batches(self, dataset, options)

    def distribute_datasets_from_function(self, dataset_fn, options=None):
        """Calls ``dataset_fn(InputContext)`` per pipeline; replicas take its batches in turn."""
        return DistributedDataset.from_function(self, dataset_fn, options)

    def experimental_distribute_datasets_from_function(self, dataset_fn, options=None):
        """TF's deprecated name of ``distribute_datasets_from_function`` (older code uses it).

        >>> import warnings, numpy as np, keras_dist as kd
        >>> strategy = kd.MirroredStrategy(["/cpu:0", "/cpu:1"])
        >>> with warnings.catch_warnings():
        ...     warnings.simplefilter("ignore", DeprecationWarning)
        ...     dataset = strategy.experimental_distribute_datasets_from_function(
        ...         lambda ctx: [np.ones(2), np.zeros(2)])
        >>> [v.tolist() for v in strategy.experimental_local_results(next(iter(dataset)))]
        [[1.0, 1.0], [0.0, 0.0]]
        """
        warnings.warn(
            "`experimental_distribute_datasets_from_function` is deprecated (as in TF): "
            "rename it to `distribute_datasets_from_function`.",
            DeprecationWarning,
            stacklevel=2,
        )
        return self.distribute_datasets_from_function(dataset_fn, options)

    def experimental_make_numpy_dataset(self, numpy_input):
        """A dataset of the rows of ``numpy_input`` (a nest of arrays); ``.batch(n)`` batches it."""
        return NumpyDataset(numpy_input)

    def __repr__(self):
        return f"{type(self).__name__}(devices={list(self._extended.worker_devices)})"


def _checked_axis(method, value, axis) -> int:
    """``axis`` as an int within one replica's rank (negative counts from the end)."""
    none_ok = " (or None)" if method == "reduce" else ""
    try:
        if isinstance(axis, bool):
            raise TypeError
        axis = operator.index(axis)
    except TypeError:
        raise TypeError(
            f"`strategy.{method}` needs `axis` to be an integer{none_ok}: the axis of "
            f"each replica's value to {method} along, e.g. axis=0. Received: "
            f"axis={axis!r} of type {type(axis).__name__}"
        ) from None
    rank = _per_replica_rank(value)
    if rank is None or -rank <= axis < rank:
        return axis
    if rank == 0:
        fix = (
            "pass axis=None to only combine the replicas"
            if method == "reduce"
            else "give each replica a value of rank 1 or more, e.g. x[None]"
        )
        reason = f"the per-replica values are scalars (rank 0), so there is no axis; {fix}"
    else:
        reason = (
            f"it must be in [-{rank}, {rank}) for per-replica values of rank {rank} "
            "(negative values count from the last axis)"
        )
    raise ValueError(
        f"`strategy.{method}` got an axis out of range: {reason}. "
        f"Received: axis={axis}, per-replica rank={rank}"
    )


def _check_alike_but_along(method, value, axis) -> None:
    """Replicas' values may differ along ``axis`` only (uneven batches)."""
    if not isinstance(value, DistributedValues) or value.stacked is not None:
        return  # one stacked array: alike by construction
    if value.traced is not None:
        return
    shapes = [tuple(np.shape(c)) for c in value.values]
    if len({len(shape) for shape in shapes}) == 1:
        at = axis % len(shapes[0])
        if len({shape[:at] + shape[at + 1 :] for shape in shapes}) == 1:
            return
    raise ValueError(
        f"`strategy.{method}` with an axis needs the replicas' values to have the same "
        f"rank and shape except along that axis ({method} along axis {axis}). Received: "
        f"per-replica shapes={shapes}, axis={axis}"
    )


def _per_replica_rank(value):
    """The rank of one replica's component of ``value``; ``None`` for a nest."""
    if isinstance(value, DistributedValues):
        if value.traced is not None:
            return np.ndim(value.traced.example)
        if value.stacked is not None:
            return value.stacked.ndim - 1
        if value.replicated is not None:
            return np.ndim(value.replicated)
        value = value.values[0]
    if hasattr(value, "ndim") or isinstance(value, (int, float, complex)):
        return np.ndim(value)
    return None  # a nest or a list: left to the reduction itself


def _is_nest(value) -> bool:
    """A tuple, list or dict, not one distributed value (a list of numbers is an array)."""
    return isinstance(value, (tuple, list, dict)) and not isinstance(value, DistributedValues)


def _is_nest_of_distributed(value) -> bool:
    leaves = jax.tree_util.tree_leaves(value, is_leaf=_is_distributed)
    return any(isinstance(v, DistributedValues) for v in leaves)


def _is_distributed(value) -> bool:
    return isinstance(value, DistributedValues)


def _map_whole(fn, tree):
    """``fn`` on each leaf of ``tree``, a distributed value being one leaf."""
    return jax.tree_util.tree_map(fn, tree, is_leaf=_is_distributed)


class _Scope:
    """What ``strategy.scope()`` returns; may be entered again, also nested.

    TF code keeps a scope object and re-enters it (``with scope:`` inside
    ``with scope:``), which a generator-based context manager cannot do.
    """

    def __init__(self, strategy):
        self._strategy = strategy
        self._entered: list = []

    def __enter__(self):
        context = _scope(self._strategy)
        strategy = context.__enter__()
        self._entered.append(context)
        return strategy

    def __exit__(self, *exc_info):
        return self._entered.pop().__exit__(*exc_info)


@contextlib.contextmanager
def _scope(strategy):
    frame = _context.current_frame()
    if frame.strategy is strategy and not frame.entered_scope and running_replica_context():
        # Already inside one of this strategy's replicas.
        yield strategy
        return
    outer = _context.other_strategy_in_scope(strategy)
    if outer is not None:
        raise RuntimeError(
            "Mixing different tf.distribute.Strategy objects: a scope of "
            f"{type(strategy).__name__} was entered inside a scope of "
            f"{type(outer).__name__}. Leave the outer scope first. "
            f"Received: strategy={strategy!r}, current={outer!r}"
        )
    # The default strategy's scope changes nothing (TF's testScopeMostlyNoOp): code
    # in it stays in the default replica context, not in a cross-replica one.
    replica_context = _context.default_replica_context_of(strategy)
    with _context.push(_context.Frame(strategy, replica_context, entered_scope=True)):
        yield strategy
    _settle_first_values(strategy)


def _settle_first_values(strategy):
    """Leaving the outermost scope gives the variables made in it worker 0's first values.

    Across processes that is a collective. Every worker leaves the scope at the
    same point of the same program (TF broadcasts at creation, the same rule),
    whereas a first read may come on the chief alone (``if chief:
    model.get_weights()``) and would then wait for the others forever.
    """
    frame = _context.current_frame()
    nested = frame.strategy is strategy and frame.entered_scope
    extended = strategy.extended
    # Not inside a trace: the engine syncs before it builds a program.
    if nested or frame.engine is not None or not isinstance(extended, MeshRuntime):
        return
    if extended.spans_processes:
        extended.sync_initial_values()


def _without_tensorflow_values(tree):
    """``tree`` with TensorFlow tensors as NumPy arrays (a ported program passes them)."""
    # Distributed values stay whole: their components are ours already.
    leaves = jax.tree_util.tree_leaves(tree, is_leaf=_is_distributed)
    for leaf in leaves:
        if isinstance(leaf, np.ndarray):
            warn_if_int64_narrowed(leaf.dtype)
    if any(is_tensorflow_value(leaf) for leaf in leaves):
        return _map_whole(to_host_array, tree)
    return tree


def _variable_copies(variable, count) -> tuple:
    """A distributed variable's per-replica values: its copies or its components."""
    traced = variable.scope_value()
    if traced is None:
        if isinstance(variable, SyncOnReadVariable):
            return tuple(variable.local_components())
        return tuple(variable.component(i) for i in range(count))
    # Inside a compiled step: the values being traced, not the stored ones.
    if isinstance(variable, MirroredVariable):
        return (variable.value,) * count
    engine = _context.current_frame().engine
    if isinstance(engine, ReplicaCopies):
        return engine.sync_on_read_components(variable)
    raise ValueError(
        "The per-replica components of a SyncOnRead variable cannot be listed inside a "
        "compiled step, where one trace stands for every replica. Read them after the "
        f"step, or read `variable.value` (aggregated). Received: variable={variable.path!r}"
    )
