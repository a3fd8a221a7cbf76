"""Compiled steps for replicas whose inputs differ in shape (the last partial batch).

One SPMD program needs the same shapes on every replica, and the last batch of a
custom loop is split unevenly (TF gives 178 rows on 4 replicas as 45/45/45/43).
Padding would change what the user's function computes, so this engine compiles
the step as it is, into one program on the first replica's device:

* the replicas are traced on threads, one at a time in replica order, exactly
  as the eager engine runs them, but all into the same JAX trace: each
  replica's code is traced at its own shapes;
* a ``merge_call`` (and so every collective) runs once on the calling thread
  inside that trace, where the replicas' values are traced arrays: a reduction
  is their sum, a gather their concatenation (``_uneven_state.CrossReplica``);
* variables are threaded as state, as in the compiled engine; each replica
  keeps its own copy of the values, as on the eager engine
  (``_uneven_state``).

Programs are cached per input signature like the compiled engine's, so a
partial batch costs one compile, then one dispatch per call. The program runs
on one device: its replicas' work is not spread over the devices, which matters
little for one batch per epoch.

Across processes one process's program cannot reach the other workers'
replicas, so every process runs them all: the per-replica inputs (their shapes
may differ between workers) and the SyncOnRead components are gathered from
every process first, every process runs the same program over every replica
(its collectives are sums inside the program, the variables are the same
everywhere), and each keeps its own replicas' outputs and components.
"""

import contextlib
import weakref

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend.core import set_current_trace
from jax.extend.core import take_current_trace

from keras_dist import _context
from keras_dist._engine._compiled import TraceRecord
from keras_dist._engine._compiled import is_array_like
from keras_dist._engine._compiled import output_value
from keras_dist._engine._compiled import program_key
from keras_dist._engine._compiled_replica import is_input_leaf
from keras_dist._engine._eager import EagerEngine
from keras_dist._engine._eager import EagerReplica
from keras_dist._engine._eager import on_device
from keras_dist._engine._lru_programs import ProgramCache
from keras_dist._engine._retracing import RetraceMonitor
from keras_dist._engine._trace_inputs import absorb_discoveries
from keras_dist._engine._trace_inputs import sort_inputs
from keras_dist._engine._uneven_state import CrossReplica
from keras_dist._engine._uneven_state import CrossReplicaView
from keras_dist._keras import RecordingScope
from keras_dist._keras import adopt_pending_variables
from keras_dist._keras import move_pending_variables
from keras_dist._values import PerReplica

_MAX_TRACES = 4
_CACHE_SIZE = 16
_ARRAY = object()  # marks an array slot in the output layout


class _Trace:
    """What the threads of the trace being built share."""

    def __init__(self, jax_trace, replica_values, cross_replica):
        self.jax_trace = jax_trace
        self.replica_values = replica_values  # one dict `id(variable) -> value` per replica
        self.cross_replica = cross_replica
        self.scopes: list = []
        self.pending: list = []  # variables the replica threads created, to initialize


class _Program:
    """One compiled uneven step and the variables it threads (held weakly)."""

    def __init__(self, compiled, mirrored, sync_on_read, foreign, out_record):
        self.compiled = compiled
        self._variables = [
            [weakref.ref(v) for v in group] for group in (mirrored, sync_on_read, foreign)
        ]
        self.out_record = out_record

    def variables(self):
        groups = [[r() for r in refs] for refs in self._variables]
        if any(v is None for group in groups for v in group):
            return None
        return groups


class _Replicas:
    """The replicas a program runs: this process's, or every process's (across processes)."""

    def __init__(self, extended):
        local = extended.num_local_replicas
        first = extended.first_local_replica_id
        self.every_process = extended.spans_processes
        if self.every_process:
            self.count, self.first_id = extended.num_replicas_in_sync, 0
            self.local = slice(first, first + local)  # this process's among them
        else:
            self.count, self.first_id, self.local = local, first, slice(0, local)


class UnevenEngine(EagerEngine):
    """Runs a replica function whose per-replica inputs differ in shape, compiled."""

    def __init__(self, extended, compiled_engine):
        super().__init__(extended)
        self._compiled_engine = compiled_engine  # its assignment check is shared
        self._cache = ProgramCache(_CACHE_SIZE)
        self._foreign: weakref.WeakValueDictionary = weakref.WeakValueDictionary()
        self._retraces = RetraceMonitor()
        self._tracing = None  # the `_Trace` while a program is traced
        self._replicas = None  # the `_Replicas` of the call being run
        self.trace_count = 0

    # --------------------------------------------------------------- calling
    def run(self, fn, args, kwargs):
        extended = self._extended
        self._replicas = _Replicas(extended)
        leaves, treedef = jax.tree_util.tree_flatten((args, kwargs), is_leaf=is_input_leaf)
        kinds, dynamic, signature, statics = sort_inputs(
            leaves,
            per_replica=lambda x: [self._on_first_device(c) for c in self._every_component(x)],
            one_value=lambda x: self._on_first_device(extended.unwrap_mirrored(x)),
        )
        function_key, _, key = program_key(fn, treedef, statics, signature, extended, self._foreign)
        program = self._cache.get(key)
        if program is not None:
            variables = program.variables()
            if variables is not None:
                self._retraces.hit(function_key.code)
                return self._call(program, variables, dynamic)
            self._cache.discard(key)
        self._cache.drop_dead_functions()
        self._retraces.traced(function_key.code, (function_key, tuple(statics), tuple(signature)))
        # The variables it was built for, held here for this call: one of a dropped model
        # may be collected while it compiles (the program holds them weakly; a later
        # call then builds it again without them).
        program, variables = self._build(fn, treedef, leaves, kinds, dynamic)
        *_, key = program_key(fn, treedef, statics, signature, extended, self._foreign)
        self._cache.put(key, program)
        return self._call(program, variables, dynamic)

    def _on_first_device(self, x):
        """``x`` on the first local replica's device, where the program runs."""
        device = self._extended.local_devices[0]
        if isinstance(x, jax.Array) and len(x.sharding.device_set) > 1:
            return on_device(x, device)
        return jax.device_put(x if isinstance(x, jax.Array) else jnp.asarray(x), device)

    def _every_component(self, value) -> list:
        """A per-replica input's components for the program: every process's, if it spans them.

        Workers' components may differ in shape (the last batch): each is padded
        to the largest, gathered, and cut back to its own shape.
        """
        if not self._replicas.every_process:
            return list(value.values)
        placement = self._extended.placement
        local = [np.asarray(c) for c in value.values]
        rank = local[0].ndim
        shapes = np.array([c.shape for c in local], np.int32).reshape(len(local), rank)
        shapes = np.asarray(placement.all_rows(placement.put_local_rows(shapes)))
        padded = np.zeros((len(local),) + tuple(shapes.max(axis=0)), local[0].dtype)
        for row, component in zip(padded, local):
            row[tuple(slice(0, n) for n in component.shape)] = component
        rows = np.asarray(placement.all_rows(placement.put_local_rows(padded)))
        return [row[tuple(slice(0, n) for n in shape)] for row, shape in zip(rows, shapes)]

    def _sync_on_read_stacked(self, variable):
        """A SyncOnRead variable's stacked components for the program (every process's, if
        it spans them)."""
        if not self._replicas.every_process:
            return variable.stored()
        return self._extended.placement.all_rows(variable.stored())

    def _program_inputs(self, mirrored, sync_on_read, foreign) -> list:
        """The variables' values as the program takes them, on the first local device."""
        first = self._extended.local_devices[0]
        return [
            [self._on_first_device(v.component(0)) for v in mirrored],
            # (Every row, gathered: ``_on_first_device`` takes a replicated array's copy.)
            [jax.device_put(self._sync_on_read_stacked(v), first) for v in sync_on_read],
            [self._on_first_device(v.value) for v in foreign],
        ]

    def _call(self, program, variables, dynamic):
        extended = self._extended
        mirrored, sync_on_read, foreign = variables
        new_mirrored, new_stacked, outputs = program.compiled(
            *self._program_inputs(mirrored, sync_on_read, foreign), dynamic
        )
        local = self._replicas.local
        placement = extended.placement
        # One batched transfer each: a step's host time is mostly these (per variable).
        for variable, value in zip(mirrored, placement.replicate_all(new_mirrored)):
            extended.store_computed(variable, value)
        if sync_on_read:
            everyone = local == slice(0, self._replicas.count)
            rows = [stacked if everyone else stacked[local] for stacked in new_stacked]
            for variable, value in zip(sync_on_read, placement.put_local_rows_all(rows)):
                variable.store(value)
        return self._assemble(program.out_record, outputs[local])

    def _assemble(self, out_record, outputs):
        """This process's replicas' outputs as the compiled engine gives them."""
        treedef, layout = out_record
        devices = self._extended.local_devices
        columns = iter(zip(*outputs)) if outputs and outputs[0] else iter(())
        leaves = []
        for slot in layout:
            if slot is not _ARRAY:
                leaves.append(slot)
                continue
            column = next(columns)
            if len(devices) == 1:
                leaves.append(column[0])
            else:
                placed = [jax.device_put(c, d) for c, d in zip(column, devices)]
                leaves.append(PerReplica(placed, _validate=False))
        return jax.tree_util.tree_unflatten(treedef, leaves)

    # -------------------------------------------------------------- building
    def _build(self, fn, treedef, leaves, kinds, dynamic):
        extended = self._extended
        strategy = extended.container_strategy
        for _ in range(_MAX_TRACES):
            state = extended.variable_state()
            mirrored, sync_on_read = list(state.mirrored), list(state.sync_on_read)
            foreign = list(self._foreign.values())
            record = TraceRecord()
            program = self._program(
                fn, treedef, leaves, kinds, (mirrored, sync_on_read, foreign), record
            )
            traced = jax.jit(program).trace(
                *self._program_inputs(mirrored, sync_on_read, foreign), dynamic
            )
            if not absorb_discoveries(strategy, list(record.unmapped.values()), self._foreign):
                break
        else:
            raise RuntimeError(
                "The replica function kept creating new variables on every trace. "
                "Create variables once, e.g. by building the model and the optimizer "
                f"before the first `strategy.run`. Received: fn={fn!r}"
            )
        self._compiled_engine.check_assignments(record, mirrored, sync_on_read)
        compiled = traced.lower().compile()
        program = _Program(compiled, mirrored, sync_on_read, foreign, record.out)
        return program, [mirrored, sync_on_read, foreign]

    def _program(self, fn, treedef, leaves, kinds, variables, record):
        """The traced function: the replicas on threads, sharing its trace and ``record``."""
        extended = self._extended
        mirrored, sync_on_read, foreign = variables
        n = self._replicas.count

        def program(mirrored_values, sync_on_read_stacked, foreign_values, dynamic_values):
            self.trace_count += 1
            shared = {id(v): x for v, x in zip(mirrored, mirrored_values)}
            shared.update({id(v): x for v, x in zip(foreign, foreign_values)})
            replica_values = []
            for i in range(n):
                values = dict(shared)
                values.update({id(v): c[i] for v, c in zip(sync_on_read, sync_on_read_stacked)})
                replica_values.append(values)
            per_replica = []
            for i in range(n):
                values = iter(dynamic_values)
                local = [
                    leaf if kind is None else (next(values)[i] if kind == "r" else next(values))
                    for leaf, kind in zip(leaves, kinds)
                ]
                per_replica.append(jax.tree_util.tree_unflatten(treedef, local))
            with take_current_trace() as jax_trace:
                pass
            tracing = _Trace(jax_trace, replica_values, CrossReplica(extended, replica_values))
            self._tracing = tracing
            try:
                with RecordingScope(CrossReplicaView(replica_values)) as merge_scope:
                    results = self.run_threads(fn, per_replica)
            finally:
                self._tracing = None
            adopt_pending_variables(tracing.pending)  # initialized on this thread
            for scope in tracing.scopes + [merge_scope]:
                record.assigned.update(scope.assigned)
                record.unmapped.update(scope.unmapped)
            outputs, record.out = _flatten_outputs(results)
            new_mirrored = [replica_values[0][id(v)] for v in mirrored]
            new_stacked = [
                jnp.stack([jnp.asarray(values[id(v)], v.dtype) for values in replica_values])
                for v in sync_on_read
            ]
            return new_mirrored, new_stacked, outputs

        return program

    # ------------------------------------------ the eager engine's hooks, traced
    def thread_devices(self) -> list:
        return [self._extended.local_devices[0]] * self._replicas.count  # one program

    def replica_id(self, index: int) -> int:
        return self._replicas.first_id + index

    def replica_engine(self, thread):
        return _UnevenReplica(thread, self._tracing.jax_trace)

    @contextlib.contextmanager
    def thread_context(self, thread):
        tracing = self._tracing
        with set_current_trace(tracing.jax_trace):
            with RecordingScope(tracing.replica_values[thread.index]) as scope:
                tracing.scopes.append(scope)
                try:
                    yield
                finally:
                    move_pending_variables(tracing.pending)

    def group_for_merge(self, per_replica_values: list):
        return self._tracing.cross_replica.group(per_replica_values)

    def merge_frame(self, strategy):
        return _context.Frame(strategy, None, engine=self._tracing.cross_replica)


class _UnevenReplica(EagerReplica):
    """A replica thread of an uneven trace: collectives take the shared trace's values."""

    def __init__(self, thread, jax_trace):
        super().__init__(thread)
        self._jax_trace = jax_trace

    def refuse_traced(self, leaves, name) -> None:
        with take_current_trace() as current:
            pass
        if current is not self._jax_trace:  # e.g. inside a gradient of the replica's own
            super().refuse_traced(leaves, name)

    def gather_in_merge(self, strategy, value, axis):
        return strategy.extended.gather_value(value, axis)


def _flatten_outputs(results):
    """Each replica's arrays, and the layout (treedef, static leaves) they fill."""
    flat = []
    treedef = None
    for result in results:
        leaves, this_def = jax.tree_util.tree_flatten(
            jax.tree_util.tree_map(output_value, result, is_leaf=is_input_leaf),
            is_leaf=lambda x: x is None,
        )
        if treedef is not None and this_def != treedef:
            raise AssertionError(
                "The replicas returned values of different structures; every replica "
                f"must return the same nest. Received: {treedef} and {this_def}"
            )
        treedef = this_def
        flat.append(leaves)
    layout = [_ARRAY if is_array_like(leaf) else leaf for leaf in flat[0]]
    outputs = [
        [jnp.asarray(leaf) for leaf, slot in zip(leaves, layout) if slot is _ARRAY]
        for leaves in flat
    ]
    return outputs, (treedef, layout)
