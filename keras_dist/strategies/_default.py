"""The default strategy: what ``get_strategy()`` returns outside any scope.

It runs functions directly on the default device with one replica, creates
plain Keras variables, and treats reductions as identities, so code written
for a strategy also runs without one.
"""

import jax

from keras_dist import _context
from keras_dist._devices import device_name
from keras_dist._reduce_op import ReduceOp
from keras_dist._replica_context import ReplicaContext
from keras_dist._values import DistributedValues
from keras_dist._values._value_context import ValueContext
from keras_dist._values._variables import DistributedVariable
from keras_dist.strategies._extended import StrategyExtended
from keras_dist.strategies._strategy import Strategy


class _DefaultExtended(StrategyExtended):
    def __init__(self, container_strategy):
        super().__init__(container_strategy)
        self._default_replica_context = ReplicaContext(container_strategy, 0, _is_default=True)

    @property
    def num_replicas_in_sync(self) -> int:
        return 1

    @property
    def local_devices(self) -> tuple:
        return (jax.devices()[0],)

    @property
    def worker_devices(self) -> tuple:
        return tuple(device_name(d) for d in self.local_devices)

    def variable_created_in_scope(self, v) -> bool:
        """TF's default strategy owns the variables no other strategy created."""
        return not isinstance(v, DistributedVariable)

    @property
    def default_replica_context(self):
        """The replica context code outside any ``run`` is in (TF's default one)."""
        return self._default_replica_context

    def call_for_each_replica(self, fn, args=(), kwargs=None, *, eagerly=False):
        kwargs = kwargs or {}
        frame = _context.current_frame()
        if frame.replica_context is self._default_replica_context:
            return fn(*args, **kwargs)
        with _context.push(_context.Frame(frame.strategy, self._default_replica_context)):
            return fn(*args, **kwargs)

    def _reduce_to(self, reduce_op, value, destinations, options):
        return _only_value(value)

    def _batch_reduce_to(self, reduce_op, value_destination_pairs, options):
        return [_only_value(v) for v, _ in value_destination_pairs]

    def _broadcast_to(self, tensor, destinations):
        return tensor

    def _update(self, var, fn, args, kwargs, group):
        return fn(var, *args, **kwargs)

    def reduce_value(self, reduce_op, value, axis):
        value = _only_value(value)
        if axis is None:
            return value
        value = jax.numpy.asarray(value)
        if reduce_op is ReduceOp.SUM:
            return jax.numpy.sum(value, axis=axis)
        return jax.numpy.mean(value, axis=axis)

    def gather_value(self, value, axis):
        return _only_value(value)

    def distribute_values_from_function(self, value_fn):
        return value_fn(ValueContext(0, 1))


def _only_value(value):
    if isinstance(value, DistributedValues):
        if len(value.values) != 1:
            raise ValueError(
                "The default strategy has one replica but received a distributed value "
                f"with {len(value.values)} components. Received: {value!r}"
            )
        return value.values[0]
    return value


class _DefaultStrategy(Strategy):
    """The strategy in effect outside any scope: one replica, no distribution."""

    def __init__(self):
        super().__init__(_DefaultExtended(self))

    def __repr__(self):
        return "DefaultStrategy()"


_DEFAULT = _DefaultStrategy()
_context.set_default_strategy(_DEFAULT, _DEFAULT.extended.default_replica_context)


def default_strategy() -> Strategy:
    """The process-wide default strategy.

    >>> default_strategy() is default_strategy()
    True
    """
    return _DEFAULT
