"""`Strategy` and `StrategyExtended`: the public face every strategy shares.

A strategy describes *what* (devices, variable policy, reductions); its
``extended`` object and the engines do *how*. Methods check the context they
are called in and fail early with the fix in the message.
"""

import contextlib
from typing import Any

from keras_dist import _context
from keras_dist._input._dataset import DistributedDataset
from keras_dist._input._dataset import InputContext
from keras_dist._input._dataset import NumpyDataset
from keras_dist._reduce_op import ReduceOp
from keras_dist._values._distributed_values import DistributedValues

_CROSS_REPLICA_ONLY = (
    "Method requires being in cross-replica context, use get_replica_context().merge_call()"
)


def require_cross_replica(strategy, method: str) -> None:
    """Raises if called inside one of ``strategy``'s replicas."""
    replica_context = _context.current_frame().replica_context
    if replica_context is not None and not replica_context._is_default:
        raise RuntimeError(f"{_CROSS_REPLICA_ONLY}. Received: a call to `{method}`.")


class Strategy:
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
        return self._extended._num_replicas_in_sync

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

    def run(self, fn, args=(), kwargs=None, options=None):
        """Runs ``fn(*args, **kwargs)`` on every replica; returns ``PerReplica`` results.

        ``PerReplica`` arguments give each replica its own component; other
        arrays are the same on every replica. By default ``fn`` is traced once
        per input signature and compiled (see ``keras_dist.config``); Python
        scalars and other non-array arguments are constants of the trace.
        Call in cross-replica context.
        """
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
        """
        reduce_op = ReduceOp.from_value(reduce_op)
        require_cross_replica(self, "reduce")
        return self._extended._reduce(reduce_op, value, axis)

    def experimental_local_results(self, value) -> tuple:
        """The components of ``value`` on this process's replicas, as a tuple.

        A non-distributed value gives ``(value,)``. Callable in any context.
        """
        if isinstance(value, DistributedValues):
            return value.values
        if _is_nest_of_distributed(value):
            import jax

            n = len(self._extended._devices)
            return tuple(
                jax.tree_util.tree_map(
                    lambda v, i=i: v.values[i] if isinstance(v, DistributedValues) else v,
                    value,
                    is_leaf=lambda v: isinstance(v, DistributedValues),
                )
                for i in range(n)
            )
        return (value,)

    def gather(self, value, axis: int):
        """Concatenates the replicas' components of ``value`` along ``axis``.

        Call in cross-replica context; in a replica use ``ReplicaContext.all_gather``.
        """
        require_cross_replica(self, "gather")
        return self._extended._gather(value, axis)

    def experimental_distribute_values_from_function(self, value_fn):
        """Builds a ``PerReplica`` from ``value_fn(ValueContext)`` called once per replica.

        >>> import keras_dist as kd
        >>> strategy = kd.MirroredStrategy(["/cpu:0", "/cpu:1"])
        >>> v = strategy.experimental_distribute_values_from_function(
        ...     lambda ctx: ctx.replica_id_in_sync_group * 10.0)
        >>> [float(x) for x in strategy.experimental_local_results(v)]
        [0.0, 10.0]
        """
        return self._extended._distribute_values_from_function(value_fn)

    def experimental_distribute_dataset(self, dataset, options=None):
        """Splits each global batch of ``dataset`` between the replicas.

        ``dataset`` is any re-iterable of global batches (nests of arrays). A
        last partial batch is split as evenly as possible; some replicas may
        get empty batches, as in TF.
        """
        return DistributedDataset.from_global_batches(self, dataset, options)

    def distribute_datasets_from_function(self, dataset_fn, options=None):
        """Calls ``dataset_fn(InputContext)`` per pipeline; replicas take its batches in turn."""
        return DistributedDataset.from_function(self, dataset_fn, options)

    def experimental_make_numpy_dataset(self, numpy_input):
        """A dataset of the rows of ``numpy_input`` (a nest of arrays); ``.batch(n)`` batches it."""
        return NumpyDataset(numpy_input)

    def _input_context(self) -> InputContext:
        return InputContext(1, 0, self.num_replicas_in_sync)

    def __repr__(self):
        return f"{type(self).__name__}(devices={list(self._extended.worker_devices)})"


def _is_nest_of_distributed(value) -> bool:
    import jax

    leaves = jax.tree_util.tree_leaves(value, is_leaf=lambda v: isinstance(v, DistributedValues))
    return any(isinstance(v, DistributedValues) for v in leaves)


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
    if frame.strategy is strategy and frame.replica_context is not None and not frame.entered_scope:
        if not frame.replica_context._is_default:
            # Already inside one of this strategy's replicas.
            yield strategy
            return
    for outer in _context.frames():
        if outer.strategy is not strategy:
            raise RuntimeError(
                "Mixing different tf.distribute.Strategy objects: a scope of "
                f"{type(strategy).__name__} was entered inside a scope of "
                f"{type(outer.strategy).__name__}. Leave the outer scope first. "
                f"Received: strategy={strategy!r}, current={outer.strategy!r}"
            )
    # The default strategy's scope changes nothing (TF's testScopeMostlyNoOp): code
    # in it stays in the default replica context, not in a cross-replica one.
    replica_context = getattr(strategy.extended, "_default_replica_context", None)
    with _context.push(_context.Frame(strategy, replica_context, entered_scope=True)):
        yield strategy


class StrategyExtended:
    """Additional APIs for algorithms that need to be distribution-aware.

    Cross-replica-only methods (``reduce_to``, ``batch_reduce_to``,
    ``broadcast_to``, ``update``) raise in a replica context: call them from a
    ``merge_call``. Every concrete strategy's extended object derives from this.
    """

    _keras_distribution = None
    _num_replicas_in_sync = 1

    def __init__(self, container_strategy):
        self._container_strategy_ref = container_strategy

    def _container_strategy(self):
        return self._container_strategy_ref

    # Properties every strategy answers the same way on one host.
    @property
    def should_checkpoint(self) -> bool:
        """Whether this process should save checkpoints (the chief only)."""
        return True

    @property
    def should_save_summary(self) -> bool:
        """Whether this process should write summaries (the chief only)."""
        return True

    @property
    def experimental_should_init(self) -> bool:
        """Whether this process should run variable initializers."""
        return True

    @property
    def experimental_between_graph(self) -> bool:
        """Whether each worker runs its own program (multi-worker strategies)."""
        return False

    @property
    def experimental_require_static_shapes(self) -> bool:
        """Whether inputs must have static shapes.

        ``False``: partial batches are handled (split unevenly in custom loops,
        padded and masked in ``fit``).
        """
        return False

    def call_for_each_replica(self, fn, args=(), kwargs=None):
        """Runs ``fn`` once per replica; the same as ``strategy.run``."""
        raise NotImplementedError

    def reduce_to(self, reduce_op, value, destinations, options=None):
        """Combines ``value`` across replicas onto ``destinations``. Cross-replica only."""
        raise NotImplementedError

    def batch_reduce_to(self, reduce_op, value_destination_pairs, options=None):
        """Several ``reduce_to`` in one fused reduction. Cross-replica only."""
        raise NotImplementedError

    def broadcast_to(self, tensor, destinations):
        """Copies ``tensor`` to ``destinations`` as a ``Mirrored`` value. Cross-replica only."""
        raise NotImplementedError

    def update(self, var, fn, args=(), kwargs=None, group=True):
        """Runs ``fn(var, *args, **kwargs)`` to update ``var`` everywhere. Cross-replica only."""
        raise NotImplementedError

    def colocate_vars_with(self, colocate_with_variable):
        """A scope in which variables go where ``colocate_with_variable`` is.

        Every variable of a mirrored strategy is on every replica's device, so
        this changes nothing here; it exists for code written for TF.
        """
        return contextlib.nullcontext()

    def value_container(self, value) -> Any:
        """The distributed variable ``value`` belongs to, or ``value`` itself."""
        return value

    def _replica_ctx_all_reduce(self, reduce_op, value, options=None):
        """``get_replica_context().all_reduce``; TF code and tests call it by this name.

        Call in a replica context.
        """
        replica_context = _context.get_replica_context()
        if replica_context is None:
            raise RuntimeError(
                "`_replica_ctx_all_reduce` must be called in a replica context, inside "
                "`strategy.run`. In the cross-replica context use `reduce_to`. "
                f"Received: value={value!r}"
            )
        return replica_context.all_reduce(reduce_op, value, options)

    def _reduce(self, reduce_op, value, axis):
        raise NotImplementedError

    def _gather(self, value, axis):
        raise NotImplementedError

    def _distribute_values_from_function(self, value_fn):
        raise NotImplementedError

    def _unwrap_mirrored(self, value):
        return value
