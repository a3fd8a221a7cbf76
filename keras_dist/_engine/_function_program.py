"""One compiled program of a ``kd.function``: its call, and the state it threads.

A program holds its variables weakly (a dropped model's death marks it stale)
and remembers the strategies' variable versions it was built at; ``current``
says whether it still applies. Where a version changed but the function,
traced again with the program's own variables, is the same program
(``_program_reuse.py``), ``rebuilt_as`` keeps it.
"""

import contextlib
import functools
import weakref

import jax

from keras_dist._capabilities import MeshRuntime
from keras_dist._engine._donation import StoredOutputs
from keras_dist._engine._donation import copy_shared_buffers
from keras_dist._engine._donation import copy_stored_arguments
from keras_dist._engine._donation import keep_placed
from keras_dist._engine._function_outputs import rebuild_outputs
from keras_dist._engine._function_placement import ProgramPlacement
from keras_dist._engine._function_state import holding as _holding
from keras_dist._engine._function_state import is_mirrored
from keras_dist._engine._function_state import state_access as _state_access
from keras_dist._engine._gate import GATE
from keras_dist._engine._interrupts import interrupts_held
from keras_dist._values._local_results import local_only


class FunctionProgram:
    """One compiled program of a ``kd.function``, and the state it threads (weakly)."""

    def __init__(self, lowered, traced_state, extendeds, out_record, layout, fingerprint):
        self.compiled = compiled = lowered.compile()
        self.layout = layout  # written variables first: only they are donated and returned
        # To trace again with this program's own variables (``_program_reuse.py``).
        self.fingerprint = fingerprint
        self._traced_state = [weakref.ref(v) for v in traced_state]
        state = layout.ordered(0, traced_state)
        self.lowered = lowered  # kept for inspection: tests count collectives in it
        # Held weakly; a variable's death marks the program stale (no check per call).
        self._liveness = _Liveness()
        self._state = [weakref.ref(v, self._liveness.died) for v in state]
        self.extendeds = extendeds
        # Calls into the first strategy are serialized (``StrategyExtended.lock``).
        self.lock = extendeds[0].lock if extendeds else contextlib.nullcontext()
        # ``cut_to_local``: the outputs hold ``LocalResults`` (only across processes).
        self.out_treedef, self.out_layout, self.cut_to_local = out_record
        self.versions = versions(extendeds)
        self._mesh = next((e for e in extendeds if isinstance(e, MeshRuntime)), None)
        # How each variable is read and written back, decided once: a step's host
        # work is this loop, so it should not ask each variable what it is.
        self._access = [_state_access(v, extendeds) for v in state]
        self._held = [_holding(v) for v in state]
        self._read_only = layout.written(0)  # the variables after these are only read
        # Only mirrored variables' reads are their stored arrays, placed (``keep_placed``).
        self._keeps_placed = [
            i for i in range(self._read_only, len(state)) if is_mirrored(state[i])
        ]
        self._stored = StoredOutputs()
        # Where the program takes its array arguments (after the threaded state).
        self._placement = ProgramPlacement(compiled.input_shardings[0][-1])
        shardings = jax.tree_util.tree_leaves(compiled.output_shardings)
        self._one_device = all(len(s.device_set) == 1 for s in shardings)

    def current(self) -> bool:
        return self._liveness.alive and self.versions == versions(self.extendeds)

    def traced_state(self) -> "list | None":
        """The threaded variables in the order they were traced (``None``: one is gone)."""
        state = [r() for r in self._traced_state]
        return state if self._liveness.alive and all(v is not None for v in state) else None

    def keep(self) -> None:
        """Marks the program current again: the strategies' new variables are not its."""
        self.versions = versions(self.extendeds)

    def __call__(self, dynamic):
        state = [r() for r in self._state]
        values = [held(v) for held, v in zip(self._held, state)]
        if not self._stored.unchanged(values):  # else the arrays this program's last call left
            copy_stored_arguments(dynamic, values)
            values = [read(v) for (read, _), v in zip(self._access, state)]
            kept = self._keeps_placed
            if kept and not keep_placed([state[i] for i in kept], [values[i] for i in kept]):
                self._keeps_placed = []  # stored apart (a central device): they only move
        copy_shared_buffers(values, dynamic)  # an argument may be a variable's own buffer
        dynamic = self._placement.of(dynamic)
        if self._mesh is not None:
            # As the strategy runs its programs: across processes under the peer
            # watch, so that a lost worker is named instead of waited on forever.
            execute = self._mesh.placement.execute
        else:
            execute = functools.partial(GATE.call, False)
        with interrupts_held():  # (the variables' arrays are donated until written again)
            new_state, outputs = execute(self.compiled, *self.layout.arguments(values, dynamic))
            for (_, write), variable, value in zip(self._access, state, new_state):
                write(variable, value)  # (only the written ones came back: the first)
            self._stored.remember(new_state + values[len(new_state) :])
        outputs = rebuild_outputs(self.out_treedef, self.out_layout, outputs, self._one_device)
        return local_only(outputs) if self.cut_to_local else outputs


class _Liveness:
    """Whether every variable of a program is alive (told by their weak references)."""

    alive = True

    def died(self, _reference) -> None:
        self.alive = False


def versions(extendeds) -> tuple:
    return tuple(e.variable_state().version for e in extendeds)
