"""Which variables a compiled program writes: only those are donated and returned.

The engine traces a replica function with every variable of the strategy
threaded through it as donated state, because it cannot know beforehand which
ones the function reads or writes. Most programs write only some: ``predict``
none, ``evaluate`` its metrics, and neither touches the optimizer's slots.
Each variable a program gives back costs an output buffer, a ``jax.Array``
around it and a store on the host, a few µs per variable per call: on a small
model with Adam's slots, more than the step's own work.

``StateLayout`` rebuilds the traced program from its jaxpr, without running
the function again, so that the variables it leaves as they were go in
without being donated and do not come out. ``jax.jit`` then drops those it
does not read at all (``keep_unused=False``). Variables that are written come
first, in both the program's arguments and the entry's variables.

>>> layout = StateLayout(unchanged_mirrored=[True, False, True], unchanged_sync=[])
>>> layout.ordered_mirrored(["a", "b", "c"]), layout.written_mirrored
(['b', 'a', 'c'], 1)
>>> layout.arguments(["b", "a", "c"], [], [], [])
(['b'], ['a', 'c'], [], [], [], [])
>>> StateLayout([False], [False]).arguments(["a"], ["s"], [], [])
(['a'], ['s'], [], [])
"""

import jax
from jax.extend.core import jaxpr_as_fun


def _written_first(unchanged: list) -> list:
    """Indices: the written entries first, then the unchanged ones, each in order."""
    return [i for i, same in enumerate(unchanged) if not same] + [
        i for i, same in enumerate(unchanged) if same
    ]


class StateLayout:
    """How one program takes its threaded state: written variables donated, the rest read.

    ``unchanged_mirrored[i]`` (``unchanged_sync[i]``) says whether the trace gave
    back the i-th mirrored (SyncOnRead) variable's value exactly as it took it.
    """

    def __init__(self, unchanged_mirrored: list, unchanged_sync: list):
        self._mirrored_order = _written_first(unchanged_mirrored)
        self._sync_order = _written_first(unchanged_sync)
        self.written_mirrored = unchanged_mirrored.count(False)
        self.written_sync = unchanged_sync.count(False)
        # Every variable written: the traced program is used as it is.
        self.writes_all = not any(unchanged_mirrored) and not any(unchanged_sync)

    def ordered_mirrored(self, items: list) -> list:
        """``items`` (one per mirrored variable, in trace order) in the program's order."""
        return [items[i] for i in self._mirrored_order]

    def ordered_sync(self, items: list) -> list:
        """``items`` (one per SyncOnRead variable, in trace order) in the program's order."""
        return [items[i] for i in self._sync_order]

    def arguments(self, mirrored, sync_on_read, foreign, dynamic) -> tuple:
        """The program's arguments from the state in the program's order."""
        if self.writes_all:
            return mirrored, sync_on_read, foreign, dynamic
        m, s = self.written_mirrored, self.written_sync
        return mirrored[:m], mirrored[m:], sync_on_read[:s], sync_on_read[s:], foreign, dynamic

    def lower(self, traced, mirrored, sync_on_read, foreign, dynamic):
        """``traced`` (``jit(...).trace(mirrored, sync_on_read, foreign, dynamic)`` of a
        program returning ``(new_mirrored, new_sync_on_read, *outputs)``) lowered for
        this layout; the arguments are the ones it was traced with, in trace order.
        """
        if self.writes_all:
            return traced.lower()
        run_traced = jaxpr_as_fun(traced.jaxpr)
        out_tree = jax.tree.structure(traced.out_info)
        mirrored_at = _positions(self._mirrored_order)
        sync_at = _positions(self._sync_order)
        m, s = self.written_mirrored, self.written_sync

        def program(written_m, read_m, written_s, read_s, foreign, dynamic):
            taken_m, taken_s = [*written_m, *read_m], [*written_s, *read_s]
            state = (
                [taken_m[p] for p in mirrored_at],
                [taken_s[p] for p in sync_at],
                foreign,
                dynamic,
            )
            flat = run_traced(*jax.tree.leaves(state))
            new_m, new_s, *outputs = jax.tree.unflatten(out_tree, flat)
            written = (
                [new_m[i] for i in self._mirrored_order[:m]],
                [new_s[i] for i in self._sync_order[:s]],
            )
            return (*written, *outputs)

        jitted = jax.jit(program, donate_argnums=(0, 2), keep_unused=False)
        arguments = self.arguments(
            self.ordered_mirrored(mirrored), self.ordered_sync(sync_on_read), foreign, dynamic
        )
        return jitted.trace(*arguments).lower()


def _positions(order: list) -> list:
    """``positions[i]``: where trace index ``i`` sits in ``order``."""
    positions = [0] * len(order)
    for place, index in enumerate(order):
        positions[index] = place
    return positions
