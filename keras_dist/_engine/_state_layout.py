"""Which variables a compiled program writes: only those are donated and returned.

The engines trace a function with every variable of the strategy threaded
through it as donated state, because they cannot know beforehand which ones
the function reads or writes. Most programs write only some: ``predict``
none, ``evaluate`` its metrics, and neither touches the optimizer's slots.
Each variable a program gives back costs an output buffer, a ``jax.Array``
around it and a store on the host, a few µs per variable per call: on a small
model with Adam's slots, more than the step's own work.

``StateLayout`` rebuilds the traced program from its jaxpr, without running
the function again, so that the variables it leaves as they were go in
without being donated and do not come out. ``jax.jit`` then drops those it
does not read at all (``keep_unused=False``).

A traced program takes ``(*groups, *rest)``, each group a list of variables'
values (the compiled engine: mirrored and SyncOnRead variables; ``kd.function``:
one), and returns ``(*new_groups, *outputs)``. Its rebuilt program takes each
group as two lists, the written variables (donated) and the others, and
returns only the written ones' new values. Within a group the written
variables come first, in the program's arguments and in the caller's order.

>>> layout = StateLayout([[True, False, True]])
>>> layout.ordered(0, ["a", "b", "c"]), layout.written(0)
(['b', 'a', 'c'], 1)
>>> layout.arguments(["b", "a", "c"], "dynamic")
(['b'], ['a', 'c'], 'dynamic')
>>> StateLayout([[False], [False]]).arguments(["a"], ["s"], "dynamic")
(['a'], ['s'], 'dynamic')
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

    ``unchanged[g][i]`` says whether the trace gave back the i-th variable of
    group ``g`` exactly as it took it.
    """

    def __init__(self, unchanged: list):
        self._orders = [_written_first(flags) for flags in unchanged]
        self._written = [flags.count(False) for flags in unchanged]
        # Every variable written: the traced program is used as it is.
        self.writes_all = not any(any(flags) for flags in unchanged)

    def ordered(self, group: int, items: list) -> list:
        """``items`` (one per variable of ``group``, in trace order) in the program's order."""
        return [items[i] for i in self._orders[group]]

    def written(self, group: int) -> int:
        """How many of ``group``'s variables the program writes (they come first)."""
        return self._written[group]

    def arguments(self, *args) -> tuple:
        """The program's arguments from ``(*groups, *rest)``, the groups in program order."""
        if self.writes_all:
            return args
        count = len(self._orders)
        split = []
        for values, written in zip(args[:count], self._written):
            split += [values[:written], values[written:]]
        return (*split, *args[count:])

    def lower(self, traced, *args):
        """``traced`` (a ``jit(...).trace(*args)``) lowered for this layout; ``args`` are
        the ones it was traced with, the groups in trace order."""
        if self.writes_all:
            return traced.lower()
        run_traced = jaxpr_as_fun(traced.jaxpr)
        out_tree = jax.tree.structure(traced.out_info)
        orders, count = self._orders, len(self._orders)
        positions = [_positions(order) for order in orders]

        def program(*arguments):
            split, rest = arguments[: 2 * count], arguments[2 * count :]
            groups = []
            for g in range(count):
                taken = [*split[2 * g], *split[2 * g + 1]]
                groups.append([taken[p] for p in positions[g]])
            flat = run_traced(*jax.tree.leaves((*groups, *rest)))
            results = jax.tree.unflatten(out_tree, flat)
            new_groups, outputs = results[:count], results[count:]
            written = [
                [new[i] for i in order[:w]]
                for new, order, w in zip(new_groups, orders, self._written)
            ]
            return (*written, *outputs)

        donated = tuple(range(0, 2 * count, 2))
        jitted = jax.jit(program, donate_argnums=donated, keep_unused=False)
        groups = [self.ordered(g, args[g]) for g in range(count)]
        return jitted.trace(*self.arguments(*groups, *args[count:])).lower()


def _positions(order: list) -> list:
    """``positions[i]``: where trace index ``i`` sits in ``order``."""
    positions = [0] * len(order)
    for place, index in enumerate(order):
        positions[index] = place
    return positions
