"""The replica side of a compiled trace: what ``ReplicaContext`` asks while ``fn`` is traced.

Inside ``shard_map`` one trace stands for every replica. Collectives are
``lax`` collectives over the ``"replica"`` axis; ``merge_call`` runs its
function at trace time in the cross-replica context, where each distributed
argument is this replica's traced component (``_TracedValue``) whose other
components are reached through collectives.
"""

import jax
import jax.numpy as jnp
from jax import lax

from keras_dist import _context
from keras_dist._engine_contract import ReplicaEngine
from keras_dist._engine_contract import TracedMerge
from keras_dist._keras import KerasVariable
from keras_dist._mesh import REPLICA_AXIS as AXIS
from keras_dist._reduce_op import ReduceOp
from keras_dist._values import DistributedValues
from keras_dist._values import Mirrored
from keras_dist._values import PerReplica


def is_input_leaf(x):
    """The leaves a replica function's arguments and results are flattened to."""
    return x is None or isinstance(x, (DistributedValues, KerasVariable))


class _TracedValue:
    """This replica's component of a distributed value inside a compiled merge_call."""

    def __init__(self, local, engine):
        self.local = local
        self.engine = engine

    @property
    def example(self):
        """A component to read the rank and dtype from."""
        return self.local

    def all_components(self) -> tuple:
        gathered = lax.all_gather(self.local, AXIS)
        return tuple(gathered[i] for i in range(self.engine.num_replicas))


class CompiledReplica(ReplicaEngine, TracedMerge):
    """The replica side of a trace: collectives and merge_call for ``ReplicaContext``."""

    compiled = True

    def __init__(self, extended):
        self._extended = extended
        self.num_replicas = extended.num_replicas_in_sync
        self.replica_context = None

    @property
    def _cross_device_ops(self):
        return self._extended.cross_device_ops

    def _wrap_traced(self, x):
        if isinstance(x, jax.core.Tracer):
            return PerReplica(None, _traced=_TracedValue(x, self), _validate=False)
        return x

    def merge_call(self, replica_context, merge_fn, args, kwargs):
        strategy = self._extended.container_strategy
        args, kwargs = jax.tree_util.tree_map(
            self._wrap_traced, (args, kwargs), is_leaf=is_input_leaf
        )
        with _context.push(_context.Frame(strategy, None, engine=self)):
            result = merge_fn(strategy, *args, **kwargs)
        return jax.tree_util.tree_map(local_part, result, is_leaf=is_input_leaf)

    def call_for_each_replica(self, fn, args, kwargs):
        """``call_for_each_replica`` from a merge_fn of this trace: its replicas run ``fn``.

        The program already runs once per replica under ``shard_map``, and JAX
        does not allow a second ``shard_map`` over the same mesh inside it.
        """
        strategy = self._extended.container_strategy
        args, kwargs = jax.tree_util.tree_map(local_part, (args, kwargs), is_leaf=is_input_leaf)
        with _context.push(_context.Frame(strategy, self.replica_context, engine=self)):
            result = fn(*args, **kwargs)
        return jax.tree_util.tree_map(self._wrap_traced, result, is_leaf=is_input_leaf)

    def all_reduce(self, reduce_op, value):
        leaves, treedef = jax.tree_util.tree_flatten(value)
        leaves = [jnp.asarray(x) for x in leaves]
        reduced = self._cross_device_ops.reduce_in_replica(
            reduce_op, leaves, self.num_replicas, true_mean=self._true_mean
        )
        return jax.tree_util.tree_unflatten(treedef, reduced)

    @property
    def _true_mean(self) -> bool:
        """TF divides a MEAN of integers into a float on one host (see ``reduce_in_replica``)."""
        return not self._extended.spans_processes

    def all_gather(self, value, axis):
        return jax.tree_util.tree_map(
            lambda x: lax.all_gather(jnp.asarray(x), AXIS, axis=axis, tiled=True), value
        )

    def aggregate_sync_on_read(self, variable, local):
        aggregation = variable.read_aggregation
        if aggregation == "only_first_replica":
            return lax.all_gather(local, AXIS)[0]
        op = ReduceOp.from_variable_aggregation(aggregation)
        return self._cross_device_ops.reduce_in_replica(op, [local], self.num_replicas)[0]

    def reduce_traced(self, reduce_op, values) -> list:
        """``batch_reduce_to`` inside a merge_call: one fused reduction for all values."""
        results = [None] * len(values)
        positions, locals_ = [], []
        for i, value in enumerate(values):
            if isinstance(value, DistributedValues):
                positions.append(i)
                locals_.append(local_part(value))
            else:
                results[i] = self._extended.reduce_non_distributed(reduce_op, value)
        reduced = self._cross_device_ops.reduce_in_replica(
            reduce_op, locals_, self.num_replicas, true_mean=self._true_mean
        )
        for i, r in zip(positions, reduced):
            results[i] = Mirrored(None, _traced=_TracedValue(r, self), _validate=False)
        return results

    def reduce_with_axis(self, reduce_op, value, axis):
        local = local_part(value)
        if axis is None:
            integer = jnp.issubdtype(jnp.result_type(local), jnp.integer)
            if reduce_op is ReduceOp.MEAN and integer and not self._extended.spans_processes:
                # TF's MEAN of integers is a float (replica ids 0..3 give 1.5).
                return lax.psum(local, AXIS) / self.num_replicas
            return self.reduce_traced(reduce_op, [value])[0].local()
        total = lax.psum(jnp.sum(local, axis=axis), AXIS)
        if reduce_op is ReduceOp.SUM:
            return total
        return total / (jnp.shape(local)[axis] * self.num_replicas)

    def gather_traced(self, value, axis):
        return lax.all_gather(local_part(value), AXIS, axis=axis, tiled=True)

    def update_component(self, variable, fn, args, kwargs):
        """``extended.update`` of a SyncOnRead variable with per-replica arguments.

        In a trace each replica updates its own component with its own part.
        """
        strategy = self._extended.container_strategy
        args, kwargs = jax.tree_util.tree_map(local_part, (args, kwargs), is_leaf=is_input_leaf)
        with _context.push(_context.Frame(strategy, self.replica_context, engine=self)):
            return fn(variable, *args, **kwargs)


def local_part(x):
    """This replica's component of a value inside a compiled ``merge_call``; others as is."""
    if isinstance(x, DistributedValues) and x.traced is not None:
        return x.traced.local
    return x
