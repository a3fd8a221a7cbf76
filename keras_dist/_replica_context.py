"""`ReplicaContext`: what code running in one replica can ask and do."""

from typing import Any

from keras_dist import _context
from keras_dist._reduce_op import ReduceOp
from keras_dist._values._distributed_values import DistributedValues


class ReplicaContext:
    """The context of one replica, as seen by the function given to ``strategy.run``.

    Obtain it with ``keras_dist.get_replica_context()``. Its methods may only be
    called in a replica context (inside ``strategy.run``, or in the default
    state outside any scope).

    >>> import keras_dist as kd
    >>> strategy = kd.MirroredStrategy(["/cpu:0", "/cpu:1"])
    >>> def step():
    ...     ctx = kd.get_replica_context()
    ...     return ctx.all_reduce("SUM", 1.0) + ctx.replica_id_in_sync_group
    >>> [float(v) for v in strategy.experimental_local_results(strategy.run(step))]
    [2.0, 3.0]
    """

    def __init__(
        self,
        strategy,
        replica_id_in_sync_group,
        *,
        _engine=None,
        _eager_index: "int | None" = None,
        _is_default: bool = False,
    ):
        self._strategy = strategy
        self._replica_id_in_sync_group = replica_id_in_sync_group
        self._engine = _engine
        self._eager_index = _eager_index
        self._is_default = _is_default

    @property
    def is_default(self) -> bool:
        """Whether this is the default strategy's replica context (outside any ``run``)."""
        return self._is_default

    @property
    def eager_index(self) -> "int | None":
        """This replica's local index when it runs on a thread of its own (eager engine).

        ``None`` in a compiled trace, which stands for every replica at once.
        """
        return self._eager_index

    @property
    def strategy(self):
        """The strategy this replica belongs to."""
        return self._strategy

    @property
    def num_replicas_in_sync(self) -> int:
        """How many replicas take part in each step (all processes together)."""
        return self._strategy.num_replicas_in_sync

    @property
    def replica_id_in_sync_group(self):
        """This replica's index, in ``[0, num_replicas_in_sync)``.

        In the compiled engine this is a traced integer (``lax.axis_index``); use
        it in arithmetic and ``jnp.where``, not in Python ``if``.
        """
        return self._replica_id_in_sync_group

    @property
    def devices(self) -> tuple:
        """The devices this replica runs on, as TF-style device names."""
        devices = self._strategy.extended.worker_devices
        if self._eager_index is not None:
            return (devices[self._eager_index],)
        # A compiled trace stands for every replica at once: all their devices.
        return devices

    def merge_call(self, merge_fn, args=(), kwargs=None) -> Any:
        """Runs ``merge_fn(strategy, *args, **kwargs)`` once, in cross-replica context.

        Every replica must call it. Arguments that differ between replicas reach
        ``merge_fn`` as ``PerReplica`` values; each replica gets back its own part
        of the result.
        """
        kwargs = kwargs or {}
        if not callable(merge_fn):
            raise TypeError(
                "`merge_call` needs a callable `merge_fn(strategy, *args, **kwargs)`. "
                f"Received: merge_fn={merge_fn!r}"
            )
        frame = _context.current_frame()
        if frame.replica_context is not self:
            raise RuntimeError(
                "`merge_call` must be called from the replica it belongs to, inside "
                "`strategy.run`; it was called in another context. Received: "
                f"current replica context={frame.replica_context!r}"
            )
        if self._is_default:
            with _context.push(_context.Frame(self._strategy, None)):
                return merge_fn(self._strategy, *args, **kwargs)
        return self._engine.merge_call(self, merge_fn, args, kwargs)

    def all_reduce(self, reduce_op, value, options=None):
        """Reduces ``value`` (a nest of tensors) across replicas; every replica gets the result.

        The gradient of an all-reduce is the same all-reduce of the incoming
        gradients (compiled engine).
        """
        reduce_op = ReduceOp.from_value(reduce_op)
        if self._is_default:
            return value
        return self._engine.all_reduce(reduce_op, value)

    def all_gather(self, value, axis: int, options=None):
        """Concatenates ``value`` (a nest of tensors) of every replica along ``axis``."""
        if self._is_default:
            return value
        return self._engine.all_gather(value, axis)

    def update_on_write(self, variable, kind, value):
        """A write to a mirrored variable from this replica, combined by aggregation."""
        aggregation = variable.aggregation
        if aggregation == "none" and self._engine.compiled:
            # Every replica writes the same value (TF2's rule): no collective.
            return variable.plain_write(kind, value)
        if self._eager_index is not None and variable.scope_value() is not None:
            # Keras's stateless code on an eager replica keeps the value in its
            # own scope, out of reach of a merge_fn on another thread: combine
            # the values here, then write them into that scope.
            if aggregation in ("sum", "mean"):
                value = self.all_reduce(ReduceOp.from_variable_aggregation(aggregation), value)
            elif aggregation == "only_first_replica":
                value = self.merge_call(lambda s, v: _first_replica_value(s, v), args=(value,))
            return variable.plain_write(kind, value)

        def merge_fn(strategy, value):
            if aggregation in ("none", "only_first_replica"):
                if isinstance(value, DistributedValues):
                    value = strategy.experimental_local_results(value)[0]
            else:
                value = strategy.extended.reduce_to(
                    ReduceOp.from_variable_aggregation(aggregation), value, variable
                )
            return strategy.extended.update(
                variable, lambda v, x: getattr(v, kind)(x), args=(value,)
            )

        self.merge_call(merge_fn, args=(value,))
        # As TF's assign in a replica: this replica's copy of the new value (the
        # eager engine would otherwise hand every replica the same object, and
        # `run` would return one value instead of one per replica).
        return variable.value

    def __repr__(self):
        return (
            f"ReplicaContext(strategy={type(self._strategy).__name__}, "
            f"replica_id_in_sync_group={self._replica_id_in_sync_group!r})"
        )


def _first_replica_value(strategy, value):
    if isinstance(value, DistributedValues):
        return strategy.experimental_local_results(value)[0]
    return value
