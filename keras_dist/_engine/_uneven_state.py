"""What the replica threads of an uneven step share while it is traced.

The uneven engine (``_uneven``) traces every replica into one program, each on
its own thread, with the variables threaded as state in Keras stateless scopes.
As on the eager engine, every replica keeps its own copy of each variable's
value (one dict ``id(variable) -> value`` per replica): a mirrored variable's
copies stay equal because replicas write it through aggregation, and a
SyncOnRead variable's copies are its components. The ``merge_fn`` side reads
replica 0's copy and writes every replica's (``CrossReplicaView``).

``CrossReplica`` is that side's engine: the reductions, gathers and SyncOnRead
reads the strategy routes to the engine of a traced value.

>>> replicas = [{1: "w", 2: "a"}, {1: "w", 2: "b"}]
>>> view = CrossReplicaView(replicas)
>>> view[1], view[2]
('w', 'a')
>>> view[2] = "c"
>>> [values[2] for values in replicas]
['c', 'c']
"""

import collections.abc
import contextlib

import jax
import jax.numpy as jnp

from keras_dist import _context
from keras_dist._engine._eager import select_replica_part
from keras_dist._engine_contract import ReplicaCopies
from keras_dist._keras import RecordingScope
from keras_dist._reduce_op import ReduceOp
from keras_dist._reduce_op import mean_of
from keras_dist._replica_context import ReplicaContext
from keras_dist._values import DistributedValues
from keras_dist._values import Mirrored
from keras_dist._values import PerReplica
from keras_dist._values import regroup


class CrossReplicaView(collections.abc.MutableMapping):
    """The ``merge_fn``'s mapping over the replicas' values: reads replica 0's, writes all."""

    def __init__(self, replica_values: list):
        self._replicas = replica_values

    def __getitem__(self, key):
        return self._replicas[0][key]

    def __setitem__(self, key, value):
        for values in self._replicas:
            values[key] = value

    def __delitem__(self, key):
        for values in self._replicas:
            del values[key]

    def __iter__(self):
        return iter(self._replicas[0])

    def __len__(self):
        return len(self._replicas[0])


class ThreadValues:
    """A distributed value's components inside an uneven step's ``merge_fn``.

    The strategy hands a value carrying one of these (as ``traced``) to its
    ``engine``, the way the compiled engine's merge values are handled.
    """

    def __init__(self, components, engine):
        self.components = tuple(components)
        self.engine = engine

    def all_components(self) -> tuple:
        return self.components

    @property
    def example(self):
        """A component to read the rank and dtype from."""
        return self.components[0]

    @property
    def local(self):
        first = self.components[0]
        if any(c is not first for c in self.components[1:]):
            raise ValueError(
                "A per-replica value was used where one value for every replica is "
                "needed (e.g. written to a mirrored variable). Reduce it first with "
                "`strategy.extended.reduce_to` or `strategy.reduce`. Received: "
                f"{len(self.components)} different components"
            )
        return first


class CrossReplica(ReplicaCopies):
    """The cross-replica side of an uneven step's trace (a ``merge_fn``'s engine).

    Its values are traced, so the strategy asks it to reduce them; it holds every
    replica's copy of the variables, so a SyncOnRead write updates each copy.
    """

    def __init__(self, extended, replica_values: list):
        self._extended = extended
        self._replicas = replica_values
        self.num_replicas = len(replica_values)  # every process's, across processes

    def wrap(self, components, wrap=PerReplica):
        return wrap(None, _traced=ThreadValues(components, self), _validate=False)

    def group(self, per_replica_values: list):
        """The replicas' ``merge_call`` arguments as distributed values.

        Arrays are wrapped even when every replica passed the same one: a
        reduction then counts it once per replica, as the compiled engine does.
        """
        return regroup(
            per_replica_values,
            wrap=lambda column, _validate: self.wrap(column),
            keep_same=lambda leaf: not isinstance(leaf, (jax.Array, DistributedValues)),
        )

    # ----------------------------------------- what the strategy routes here
    def reduce_traced(self, reduce_op, values) -> list:
        results = []
        for value in values:
            if not isinstance(value, DistributedValues):
                results.append(self._extended.reduce_non_distributed(reduce_op, value))
                continue
            total = _sum(value.values, "reduce")
            if reduce_op is ReduceOp.MEAN:
                # As the compiled engine: a float on one host, as TF's MirroredStrategy.
                total = mean_of(total, self.num_replicas, self._extended.spans_processes)
            results.append(self.wrap((total,) * self.num_replicas, Mirrored))
        return results

    def reduce_with_axis(self, reduce_op, value, axis):
        components = [jnp.asarray(c) for c in value.values]
        if axis is None:
            total = _sum(components, "reduce")
            if reduce_op is ReduceOp.SUM:
                return total
            # TF's MEAN of integers on one host is a float (replica ids 0..3 give 1.5).
            return total / self.num_replicas
        total = _sum([jnp.sum(c, axis=axis) for c in components], "reduce")
        if reduce_op is ReduceOp.SUM:
            return total
        return total / sum(jnp.shape(c)[axis] for c in components)

    def gather_traced(self, value, axis):
        return jnp.concatenate([jnp.asarray(c) for c in value.values], axis=axis)

    def sync_on_read_components(self, variable) -> tuple:
        """Every replica's component of a SyncOnRead variable, as traced here."""
        return tuple(values[id(variable)] for values in self._replicas)

    def aggregate_sync_on_read(self, variable, local):
        components = list(self.sync_on_read_components(variable))
        if variable.read_aggregation == "only_first_replica":
            return components[0]
        total = _sum(components, "read")
        if variable.aggregation == "mean":
            return mean_of(total, self.num_replicas, integer_division=True)
        return total

    def update_component(self, variable, fn, args, kwargs):
        """``extended.update`` of a SyncOnRead variable with per-replica arguments."""
        strategy = self._extended.container_strategy
        results = []
        for index in range(self.num_replicas):
            context = ReplicaContext(strategy, index, _eager_index=index)
            local_args, local_kwargs = select_replica_part(index, None, (args, kwargs))
            with contextlib.ExitStack() as stack:
                stack.enter_context(_context.push(_context.Frame(strategy, context)))
                stack.enter_context(RecordingScope(self._replicas[index]))
                results.append(fn(variable, *local_args, **local_kwargs))
        return self.group(results)

    def call_for_each_replica(self, fn, args, kwargs):
        raise NotImplementedError(
            "`call_for_each_replica` inside a `merge_fn` is not supported on a step whose "
            "replicas have inputs of different shapes. Call it outside `strategy.run`. "
            f"Received: fn={fn!r}"
        )


def _sum(components, what):
    shapes = {tuple(jnp.shape(c)) for c in components}
    if len(shapes) > 1:
        raise ValueError(
            f"Cannot {what} per-replica values of different shapes: on a batch split "
            "unevenly between replicas, reduce per-example values first (e.g. "
            "`jnp.sum` in the replica), or gather them with `strategy.gather`. "
            f"Received: shapes={sorted(shapes)}"
        )
    total = jnp.asarray(components[0])
    for component in components[1:]:
        total = total + component
    return total
