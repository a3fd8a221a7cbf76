"""``strategy.run`` inside a ``kd.function`` trace: its replicas join the function's program.

While a ``kd.function`` is traced, its state is a ``FunctionScope`` (one traced
value per threaded variable) and ``strategy.run`` builds a ``shard_map`` of the
replica function over that state (``run_inline``) instead of compiling a
program of its own. ``FunctionTrace`` records what the trace met that is not
threaded yet (the function is then traced again with it).
"""

import jax
import jax.numpy as jnp
import numpy as np

from keras_dist import _context
from keras_dist._context import running_replica_context
from keras_dist._engine._compiled import TraceRecord
from keras_dist._engine._compiled import assemble_outputs
from keras_dist._engine._compiled_replica import is_input_leaf
from keras_dist._keras import RecordingScope
from keras_dist._keras import pending_variables
from keras_dist._keras import variable_has_value
from keras_dist._values import DistributedValues
from keras_dist._values import PerReplica
from keras_dist._values._variables import DistributedVariable
from keras_dist._values._variables import SyncOnReadVariable


class FunctionTrace:
    """What one trace of a ``kd.function`` needs threaded, and the strategies it ran."""

    def __init__(self, state, only_state=False):
        self.state_ids = {id(v) for v in state}
        # A ``strategy.run`` inside maps every variable of its strategy (the function may
        # read any); ``only_state`` maps the given ones only, and any other it meets is
        # needed: the trace that checks a kept program is still the function's.
        self.only_state = only_state
        self.needed: dict = {}  # id -> variable met but not threaded
        self.extendeds: list = []
        self.scope = None  # the trace's ``FunctionScope``, set when the body runs
        self.jax_trace = None  # the JAX trace the body runs in, set then too
        self.created_variables = False

    def need(self, variables) -> None:
        for variable in variables:
            if id(variable) not in self.state_ids and variable_has_value(variable):
                self.needed[id(variable)] = variable

    def ran_on(self, extended) -> None:
        if all(e is not extended for e in self.extendeds):
            self.extendeds.append(extended)


class FunctionScope(RecordingScope):
    """The state of a ``kd.function`` trace: one traced value per threaded variable.

    A SyncOnRead variable is held as its stacked ``(replicas, ...)`` components;
    read outside the replicas it is aggregated (a metric's ``result()``), and a
    write there is spread over the components as TF spreads it.
    """

    def __init__(self, mapping, trace, threaded):
        super().__init__(mapping)
        self.trace = trace
        self.threaded = threaded  # the variables given as state, in order

    def get_current_value(self, variable):
        value = super().get_current_value(variable)
        if value is None:
            self.trace.need([variable])
            return None
        if isinstance(variable, SyncOnReadVariable) and running_replica_context() is None:
            return _aggregate(variable.aggregation, value)
        return value

    def add_update(self, update):
        variable, value = update
        current = self.state_mapping.get(id(variable))
        if current is None:
            self.trace.need([variable])  # not threaded yet: the next trace will
        if isinstance(variable, SyncOnReadVariable) and running_replica_context() is None:
            # Written outside the replicas: spread over the components, as TF does.
            n = (current if current is not None else variable.stored()).shape[0]
            value = jnp.asarray(value, variable.dtype)
            if variable.aggregation == "sum":
                value = value / n
            value = jnp.broadcast_to(value, (n,) + value.shape)
        super().add_update((variable, value))

    def stored(self, variable):
        """The threaded value as stored (stacked for SyncOnRead), or ``None``."""
        return self.state_mapping.get(id(variable))

    def store(self, variable, value) -> None:
        self.assigned[id(variable)] = variable
        self.state_mapping[id(variable)] = value


def _aggregate(aggregation, stacked):
    if aggregation == "sum":
        return jnp.sum(stacked, axis=0)
    if aggregation == "mean":
        return jnp.mean(stacked, axis=0)
    return stacked[0]


def run_inline(engine, extended, fn, args, kwargs, trace):
    """``strategy.run`` inside a ``kd.function`` trace: a ``shard_map`` joining its program."""
    trace.ran_on(extended)
    scope = _function_scope()
    leaves, treedef = jax.tree_util.tree_flatten((args, kwargs), is_leaf=is_input_leaf)
    kinds, dynamic = [], []
    for leaf in leaves:
        if isinstance(leaf, PerReplica):
            kinds.append("r")
            dynamic.append(
                leaf.stacked if _traced(leaf.stacked) else extended.placement.as_stacked(leaf)
            )
        elif isinstance(leaf, DistributedValues):
            kinds.append("m")
            dynamic.append(extended.unwrap_mirrored(leaf))
        elif isinstance(leaf, (jax.Array, np.ndarray, np.generic)):
            kinds.append("m")
            dynamic.append(jnp.asarray(leaf))
        else:
            kinds.append(None)
    state = extended.variable_state()
    mirrored, sync_on_read = state.mirrored, state.sync_on_read
    if trace.only_state:
        mirrored = [v for v in mirrored if id(v) in trace.state_ids]
        sync_on_read = [v for v in sync_on_read if id(v) in trace.state_ids]
    trace.need(mirrored + sync_on_read)
    foreign = _threaded_foreign(scope)
    values = (
        [_or(scope.stored(v), lambda v=v: extended.compute_value(v)) for v in mirrored],
        [_or(scope.stored(v), v.stored) for v in sync_on_read],
        [scope.stored(v) for v in foreign],
    )
    record = TraceRecord()
    body = engine.replica_body(fn, treedef, leaves, kinds, mirrored, sync_on_read, foreign, record)
    mapped, stacked_out = engine.shard_mapped(body, kinds)
    new_mirrored, new_sync_on_read, arrays, sums, replicated = mapped(*values, dynamic)
    trace.need(
        v
        for v in record.unmapped.values()
        if trace.only_state or not isinstance(v, DistributedVariable)
    )
    threaded = {id(v) for v in mirrored} | {id(v) for v in sync_on_read}
    created = [
        v
        for v in record.assigned.values()
        if isinstance(v, DistributedVariable) and id(v) not in threaded
    ]
    if created or pending_variables():
        trace.created_variables = True  # optimizer slots made on the first trace: trace again
    else:
        engine.check_assignments(record, mirrored, sync_on_read)
    # A variable the replicas left as it was keeps the function's own value: the
    # function then does not give it back either (``_state_layout.py``).
    unchanged_mirrored, unchanged_sync = record.unchanged
    for variable, value, same in zip(mirrored, new_mirrored, unchanged_mirrored):
        if not same:
            scope.store(variable, value)
    for variable, value, same in zip(sync_on_read, new_sync_on_read, unchanged_sync):
        if not same:
            scope.store(variable, value)
    return assemble_outputs(record.out + (stacked_out,), arrays, sums, replicated)


def _function_scope() -> FunctionScope:
    return _context.current_function_trace().scope


def _threaded_foreign(scope):
    return [
        v
        for v in scope.threaded
        if not isinstance(v, DistributedVariable) and scope.stored(v) is not None
    ]


def _or(value, fallback):
    return value if value is not None else fallback()


def _traced(x) -> bool:
    return isinstance(x, jax.core.Tracer)
