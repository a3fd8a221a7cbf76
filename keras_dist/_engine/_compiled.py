"""The compiled engine: ``fn`` traced once per input signature under ``shard_map``.

``strategy.run(fn, args)`` becomes one call of a compiled program
``jax.jit(jax.shard_map(body, mesh, ...))``:

* ``PerReplica`` arguments enter stacked ``(num_replicas, ...)`` and split on
  the ``"replica"`` axis, so each replica sees its own component; other arrays
  enter replicated; anything else is a constant of the trace (and part of the
  cache key).
* Every variable the strategy created is threaded through as explicit state
  (Keras's ``StatelessScope``). Those the function writes are donated and
  written back after the call; the others go in only (``_state_layout.py``).
  Variables created during the first trace (an optimizer building its slots),
  or read although created outside the scope, make the engine trace once more
  with them included, as ``tf.function`` does when a first call creates
  variables.
* ``shard_map`` runs with ``check_vma=False``: gradients taken inside a replica
  are that replica's own, as in TF, and the optimizer's ``merge_call`` sums
  them once. (With ``check_vma=True`` JAX already sums the gradient of a
  replicated input over replicas, and an explicit reduction would count it N
  times.)
"""

import weakref

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import PartitionSpec as P

from keras_dist import _context
from keras_dist._engine._compiled_replica import CompiledReplica
from keras_dist._engine._compiled_replica import is_input_leaf
from keras_dist._engine._compiled_replica import local_part as _local_part
from keras_dist._engine._donation import StoredOutputs
from keras_dist._engine._donation import copy_shared_buffers
from keras_dist._engine._donation import copy_shared_storage
from keras_dist._engine._donation import copy_stored_arguments
from keras_dist._engine._donation import keep_placed
from keras_dist._engine._function_key import key_of
from keras_dist._engine._gate import GATE
from keras_dist._engine._interrupts import interrupts_held
from keras_dist._engine._lru_programs import ProgramCache
from keras_dist._engine._program_reuse import ProgramFingerprint
from keras_dist._engine._repeat_call import RepeatCall
from keras_dist._engine._repeat_call import StaleEntry
from keras_dist._engine._retracing import RetraceMonitor
from keras_dist._engine._state_layout import StateLayout
from keras_dist._engine._trace_inputs import absorb_discoveries
from keras_dist._engine._trace_inputs import sort_inputs
from keras_dist._keras import KerasVariable
from keras_dist._keras import RecordingScope
from keras_dist._keras import pending_variables
from keras_dist._mesh import REPLICA_AXIS as AXIS
from keras_dist._replica_context import ReplicaContext
from keras_dist._values import PerReplica
from keras_dist._values._distributed_values import LARGE_COMPONENT_BYTES

_MAX_TRACES_PER_SIGNATURE = 4
_CACHE_SIZE = 64
_ARRAY = object()  # marks an array slot in the output layout
_REPLICATED = object()  # marks a ReplicatedOutput slot


class ReplicatedOutput:
    """Marks an output that every replica computes identically (for internal callers).

    It leaves the program once, unstacked, as a plain array: no per-replica
    copies, and no reduction to read it (``fit`` returns its logs this way).
    """

    def __init__(self, value):
        self.value = value


class TraceRecord:
    """What one trace found out: outputs, assignments, unknown variables."""

    def __init__(self, join_large_outputs: bool = False):
        self.assigned: dict = {}
        self.unmapped: dict = {}
        self.out = None
        # Per mirrored and SyncOnRead variable: whether it came back as it went in.
        self.unchanged = None
        self.layout = None  # the ``StateLayout`` made of it
        self.join_large_outputs = join_large_outputs  # see ``_joins``


class _Entry:
    """One compiled program and the variables it threads (held weakly).

    A cached program must not keep a dropped model alive; when one of its
    variables is gone the strategy's variable version has changed, and the
    entry is never looked up again.
    """

    def __init__(self, extended, lowered, mirrored, sync_on_read, foreign, record, fingerprint):
        self.extended = extended
        self.lowered = lowered  # kept for inspection: tests count collectives in it
        self.compiled = lowered.compile()
        # To trace again with this program's own variables (``_program_reuse.py``).
        self.fingerprint = fingerprint
        self._traced_refs = [[weakref.ref(v) for v in g] for g in (mirrored, sync_on_read, foreign)]
        # Every threaded variable, mirrored ones first, then SyncOnRead, then foreign;
        # within each, the written ones first (``StateLayout``).
        self.layout = layout = record.layout
        self._written = layout.written(0)  # the mirrored variables that come back
        mirrored, sync_on_read = layout.ordered(0, mirrored), layout.ordered(1, sync_on_read)
        self._refs = [weakref.ref(v) for v in (*mirrored, *sync_on_read, *foreign)]
        self._bounds = (len(mirrored), len(mirrored) + len(sync_on_read))
        self.out_treedef, self.out_layout, self.has_sum, self.joined, self.stacked_out = record.out
        self._stored = StoredOutputs()
        self._keeps_placed = True  # (not where variables are stored apart: ``keep_placed``)

    def traced_variables(self) -> list:
        """The threaded variables as they were traced: ``[mirrored, sync_on_read, foreign]``."""
        groups = [[r() for r in refs] for refs in self._traced_refs]
        if any(v is None for group in groups for v in group):
            raise StaleEntry()
        return groups

    def _variables(self) -> tuple:
        """The threaded variables as ``(mirrored, sync_on_read, foreign)`` lists."""
        variables = [r() for r in self._refs]
        if any(v is None for v in variables):  # (not ``in``: a variable's ``==`` is an op)
            raise StaleEntry()
        first, second = self._bounds
        return variables[:first], variables[first:second], variables[second:]

    def __call__(self, dynamic):
        # A step ``fit`` left running (``GATE.deferring``) ends before its results
        # are read, copied or placed here.
        GATE.wait()
        extended = self.extended
        mirrored_variables, sync_on_read_variables, foreign_variables = self._variables()
        mirrored = [v.stored() for v in mirrored_variables]
        written = self._written
        if not self._stored.unchanged(mirrored):
            copy_stored_arguments(dynamic, mirrored)
            mirrored = [extended.compute_value(v) for v in mirrored_variables]
            copy_shared_storage(mirrored_variables, mirrored)
            # Variables that only go in keep the arrays placed for the program,
            # so that the next call finds them as it left them.
            if self._keeps_placed:
                self._keeps_placed = keep_placed(mirrored_variables[written:], mirrored[written:])
        sync_on_read = [v.stored() for v in sync_on_read_variables]
        copy_shared_buffers(mirrored, sync_on_read, dynamic)  # an argument may alias state
        foreign = [extended.placement.replicate(v.value) for v in foreign_variables]
        arguments = self.layout.arguments(mirrored, sync_on_read, foreign, dynamic)
        with interrupts_held():  # (the variables' arrays are donated until stored again)
            new_mirrored, new_sync_on_read, outputs, sums, replicated = extended.placement.execute(
                self.compiled, *arguments, may_run_on=True
            )
            # Only the written variables come back; they are first (``zip`` stops there).
            store = extended.store_computed
            for variable, value in zip(mirrored_variables, new_mirrored):
                store(variable, value)
            self._stored.remember(new_mirrored + mirrored[written:])
            for variable, value in zip(sync_on_read_variables, new_sync_on_read):
                variable.store(value)
        return self._outputs(outputs, sums, replicated)

    def _outputs(self, arrays, sums, replicated):
        return assemble_outputs(
            (self.out_treedef, self.out_layout, self.has_sum, self.joined, self.stacked_out),
            arrays,
            sums,
            replicated,
        )


def assemble_outputs(out_record, arrays, sums, replicated):
    """The replica function's outputs rebuilt from a program's stacked, summed and
    replicated results (``out_record`` is ``TraceRecord.out``)."""
    out_treedef, out_layout, has_sum, joined, stacked_out = out_record
    arrays, sums, replicated = iter(arrays), iter(sums), iter(replicated)
    has_sum, joined = iter(has_sum), iter(joined)
    leaves = []
    for slot in out_layout:
        if slot is _REPLICATED:
            leaves.append(next(replicated))
        elif slot is not _ARRAY:
            leaves.append(slot)
        elif stacked_out:
            if next(joined):
                value = PerReplica(None, _joined=next(arrays), _validate=False)
            else:
                value = PerReplica(None, _stacked=next(arrays), _validate=False)
            if next(has_sum):
                value.replica_sum = next(sums)
            leaves.append(value)
        else:
            leaves.append(next(arrays))
    return jax.tree_util.tree_unflatten(out_treedef, leaves)


def program_key(fn, treedef, statics, signature, extended, foreign) -> tuple:
    """What identifies a replica function's program: ``(function_key, base, full key)``.

    ``base`` is the function and its inputs; the full key adds the strategy's
    variable set and the foreign variables threaded so far (they change after
    a build that met new variables, so it is taken again after a build).
    """
    function_key = key_of(fn)
    base = (function_key, treedef, tuple(statics), tuple(signature))
    return function_key, base, base + (extended.variable_state().version, len(foreign))


class CompiledEngine:
    """Runs replica functions as one compiled SPMD program per input signature.

    The cache holds programs, not the objects they were traced from: functions
    and variables are referenced weakly, so a dropped model is freed.
    """

    def __init__(self, extended):
        self._extended = extended
        self._cache = ProgramCache(_CACHE_SIZE)
        self._foreign: weakref.WeakValueDictionary = weakref.WeakValueDictionary()
        self.trace_count = 0  # how many times a replica function was traced
        self._retraces = RetraceMonitor()

    def run(self, fn, args, kwargs):
        extended = self._extended
        leaves, treedef, (kinds, dynamic, signature, statics) = self._inputs(args, kwargs)
        function_key, base, key = program_key(
            fn, treedef, statics, signature, extended, self._foreign
        )
        entry = self._cache.get(key)
        if entry is not None:
            try:
                result = entry(dynamic)
                self._retraces.hit(function_key.code)
                return result
            except StaleEntry:
                self._cache.discard(key)
        self._cache.drop_dead_functions()
        self._retraces.traced(function_key.code, (function_key, tuple(statics), tuple(signature)))
        for _ in range(_MAX_TRACES_PER_SIGNATURE):
            entry = self._kept(self._cache.newest_of(base), fn, treedef, leaves, kinds, dynamic)
            entry = entry or self._build(fn, treedef, leaves, kinds, dynamic)
            *_, key = program_key(fn, treedef, statics, signature, extended, self._foreign)
            self._cache.put(key, entry)
            try:
                return entry(dynamic)
            except StaleEntry:
                # Variables of a dropped model, still alive when the state was
                # taken, were collected while it compiled: build without them.
                self._cache.discard(key)
        raise RuntimeError(
            "Variables kept being freed while the replica function was compiled. "
            f"Received: fn={fn!r}"
        )

    def repeat_call(self, fn, args, kwargs):
        """The program ``run(fn, args, kwargs)`` calls now as a ``RepeatCall``, or ``None``.

        ``None`` where none is cached, or where an input is more than a
        ``PerReplica`` or a constant of the trace (a ``RepeatCall`` takes only
        per-replica inputs).
        """
        extended = self._extended
        _, treedef, (kinds, _, signature, statics) = self._inputs(args, kwargs)
        if "m" in kinds:
            return None
        *_, key = program_key(fn, treedef, statics, signature, extended, self._foreign)
        entry = self._cache.get(key)
        if entry is None:
            return None
        return RepeatCall(entry, key, extended.variable_state, self._foreign, self._retraces)

    def _inputs(self, args, kwargs):
        """``(leaves, treedef, sort_inputs(leaves))`` of a replica function's arguments."""
        extended = self._extended
        leaves, treedef = jax.tree_util.tree_flatten((args, kwargs), is_leaf=is_input_leaf)
        placement = extended.placement
        sorted_inputs = sort_inputs(
            leaves,
            per_replica=placement.as_stacked,
            one_value=lambda x: placement.as_argument(extended.unwrap_mirrored(x)),
        )
        return leaves, treedef, sorted_inputs

    def _build(self, fn, treedef, leaves, kinds, dynamic):
        extended = self._extended
        strategy = extended.container_strategy
        for _ in range(_MAX_TRACES_PER_SIGNATURE):
            state = extended.variable_state()
            mirrored, sync_on_read = state.mirrored, state.sync_on_read
            foreign = list(self._foreign.values())
            variables = (mirrored, sync_on_read, foreign)
            traced, record, threaded = self._trace(fn, treedef, leaves, kinds, dynamic, variables)
            if not self._absorb_discoveries(strategy, record):
                break
        else:
            raise RuntimeError(
                "The replica function kept creating new variables on every trace. "
                "Create variables once, e.g. by building the model and the optimizer "
                f"before the first `strategy.run`. Received: fn={fn!r}"
            )
        self.check_assignments(record, mirrored, sync_on_read)
        lowered = record.layout.lower(traced, *threaded, dynamic)
        fingerprint = ProgramFingerprint(traced.jaxpr, record.out, record.unchanged)
        return _Entry(extended, lowered, *variables, record, fingerprint)

    def _trace(self, fn, treedef, leaves, kinds, dynamic, variables):
        """``fn`` traced threading ``variables`` (mirrored, SyncOnRead, foreign):
        ``(traced, record, threaded values)``."""
        extended = self._extended
        mirrored, sync_on_read, foreign = variables
        record = TraceRecord(join_large_outputs=self._joins_large_outputs())
        body = self.replica_body(
            fn, treedef, leaves, kinds, mirrored, sync_on_read, foreign, record
        )
        mapped, stacked_out = self.shard_mapped(body, kinds)
        threaded = (
            [extended.compute_value(v) for v in mirrored],
            [v.stored() for v in sync_on_read],
            [extended.placement.replicate(v.value) for v in foreign],
        )
        traced = jax.jit(mapped, donate_argnums=(0, 1)).trace(*threaded, dynamic)
        record.out = record.out + (stacked_out,)
        return traced, record, threaded

    def _kept(self, entry, fn, treedef, leaves, kinds, dynamic):
        """``entry`` (built for these inputs before the strategy's variables changed) if
        ``fn`` traced with its variables is still its program, else ``None``."""
        if entry is None:
            return None
        try:
            variables = entry.traced_variables()
        except StaleEntry:
            return None
        traced, record, _ = self._trace(fn, treedef, leaves, kinds, dynamic, variables)
        threaded = {id(v) for group in variables for v in group}
        if record.unmapped or pending_variables() or not threaded.issuperset(record.assigned):
            return None  # it read, created or wrote variables the program does not thread
        if ProgramFingerprint(traced.jaxpr, record.out, record.unchanged) != entry.fingerprint:
            return None
        return entry

    def _joins_large_outputs(self) -> bool:
        # On CPU a component cut out of a stacked output is a copy (or a ~0.5 ms
        # view): a joined output's shards are its components as they are.
        return self._extended.placement.local_devices[0].platform == "cpu"

    def shard_mapped(self, body, kinds):
        """``replica_body`` over the mesh: state and replicated inputs whole, per-replica
        inputs, SyncOnRead components and outputs split along ``"replica"``.

        Returns the mapped function and whether its outputs are stacked per replica.
        """
        extended = self._extended
        stacked_out = extended.num_replicas_in_sync > 1
        mapped = jax.shard_map(
            body,
            mesh=extended.placement.mesh,
            in_specs=(P(), P(AXIS), P(), [P(AXIS) if k == "r" else P() for k in kinds if k]),
            out_specs=(P(), P(AXIS), P(AXIS) if stacked_out else P(), P(), P()),
            check_vma=False,
        )
        return mapped, stacked_out

    def replica_body(self, fn, treedef, leaves, kinds, mirrored, sync_on_read, foreign, record):
        """The function ``shard_map`` runs: ``fn`` on one replica, variables threaded as state."""
        extended = self._extended
        strategy = extended.container_strategy

        def body(mirrored_values, sync_on_read_values, foreign_values, dynamic_values):
            self.trace_count += 1
            sync_on_read_components = [x[0] for x in sync_on_read_values]
            mapping = {id(v): x for v, x in zip(mirrored, mirrored_values)}
            mapping.update({id(v): x for v, x in zip(sync_on_read, sync_on_read_components)})
            mapping.update({id(v): x for v, x in zip(foreign, foreign_values)})
            dynamic_iter = iter(dynamic_values)
            local_leaves = []
            for leaf, kind in zip(leaves, kinds):
                if kind is None:
                    local_leaves.append(leaf)
                else:
                    value = next(dynamic_iter)
                    local_leaves.append(value[0] if kind == "r" else value)
            args, kwargs = jax.tree_util.tree_unflatten(treedef, local_leaves)
            replica = CompiledReplica(extended)
            replica_context = ReplicaContext(strategy, lax.axis_index(AXIS), _engine=replica)
            replica.replica_context = replica_context
            frame = _context.Frame(strategy, replica_context, engine=replica)
            with _context.push(frame), RecordingScope(mapping) as scope:
                outputs = fn(*args, **kwargs)
                outputs = jax.tree_util.tree_map(output_value, outputs, is_leaf=is_input_leaf)
            record.assigned = dict(scope.assigned)
            record.unmapped = dict(scope.unmapped)
            state = scope.state_mapping  # a variable left as it was holds its input itself
            record.unchanged = [
                [state[id(v)] is x for v, x in zip(mirrored, mirrored_values)],
                [state[id(v)] is x for v, x in zip(sync_on_read, sync_on_read_components)],
            ]
            record.layout = StateLayout(record.unchanged)
            new_mirrored = [scope.state_mapping[id(v)] for v in mirrored]
            new_sync_on_read = [jnp.asarray(scope.state_mapping[id(v)])[None] for v in sync_on_read]
            out_leaves, out_treedef = jax.tree_util.tree_flatten(
                outputs, is_leaf=lambda x: x is None
            )
            arrays, replicated, layout = [], [], []
            for leaf in out_leaves:
                if isinstance(leaf, ReplicatedOutput):
                    replicated.append(jnp.asarray(leaf.value))
                    layout.append(_REPLICATED)
                elif is_array_like(leaf):
                    arrays.append(jnp.asarray(leaf))
                    layout.append(_ARRAY)
                else:
                    layout.append(leaf)
            sums, joined = [], []
            if extended.num_replicas_in_sync > 1:
                sums = [lax.psum(a, AXIS) if _reduce_in_program(a) else None for a in arrays]
                joined = [record.join_large_outputs and _joins(a) for a in arrays]
                arrays = [a if join else a[None] for a, join in zip(arrays, joined)]
            record.out = (out_treedef, layout, [x is not None for x in sums], joined)
            sums = [x for x in sums if x is not None]
            return new_mirrored, new_sync_on_read, arrays, sums, replicated

        return body

    def _absorb_discoveries(self, strategy, record) -> bool:
        """Takes in variables the trace met for the first time; True to trace again."""
        return absorb_discoveries(strategy, record.unmapped.values(), self._foreign)

    def check_assignments(self, record, mirrored, sync_on_read):
        """Refuses writes, inside a replica, to variables that are not threaded as state."""
        threaded = {id(v) for v in mirrored} | {id(v) for v in sync_on_read}
        for variable in record.assigned.values():
            if id(variable) not in threaded:
                raise ValueError(
                    f"Variable {variable.path!r} was created outside `strategy.scope()` "
                    "and assigned inside `strategy.run`: the strategy does not hold it, so "
                    "the step cannot keep the write (with several replicas each would "
                    "write its own copy). Create it inside `with strategy.scope():`. "
                    f"Received: variable={variable!r}"
                )


def output_value(x):
    """A replica function's output leaf as it leaves the program (variables as values)."""
    if isinstance(x, KerasVariable):
        return x.value
    return _local_part(x)


# Small numeric outputs (losses, counts) are also summed inside the program: the
# all-reduce joins the gradients' one, and ``strategy.reduce`` of them then costs
# no further multi-device execution (which is a round trip per step on CPU).
_IN_PROGRAM_REDUCE_MAX_ELEMENTS = 16


def _joins(array) -> bool:
    # A large output leaves as its rows of one joined ``(replicas * rows, ...)`` array,
    # not a stacked ``(replicas, rows, ...)`` one: reading the components is free, and
    # stacking them to feed them back is the copy that reading would have cost.
    return array.ndim >= 1 and array.size * array.dtype.itemsize >= LARGE_COMPONENT_BYTES


def _reduce_in_program(array) -> bool:
    return array.size <= _IN_PROGRAM_REDUCE_MAX_ELEMENTS and (
        jnp.issubdtype(array.dtype, jnp.floating) or jnp.issubdtype(array.dtype, jnp.integer)
    )


def is_array_like(x) -> bool:
    """Whether an output leaf becomes an array of the program (else it is a constant)."""
    return isinstance(x, (jax.Array, np.ndarray, np.generic, bool, int, float, complex))
