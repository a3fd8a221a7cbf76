"""``LocalResults``: what ``experimental_local_results`` gives inside a traced function
that spans processes.

One program runs on every worker, so its trace holds every replica's component;
which of them are this worker's is known only when the program hands its outputs
back. The tuple carries that range through the program (it is a pytree node) and
``local_only`` keeps this worker's components then, as TF's
``experimental_local_results`` gives them.

>>> results = LocalResults((10, 11, 12, 13), first=2, count=2)
>>> local_only({"ids": results})
{'ids': (12, 13)}
"""

import jax


class LocalResults(tuple):
    """Every replica's component, and which ``count`` of them from ``first`` are local."""

    def __new__(cls, components, first: int, count: int):
        results = super().__new__(cls, components)
        results.first, results.count = first, count
        return results

    def local(self) -> tuple:
        return tuple(self[self.first : self.first + self.count])


jax.tree_util.register_pytree_node(
    LocalResults,
    lambda results: (tuple(results), (results.first, results.count)),
    lambda range_, components: LocalResults(components, *range_),
)


def local_only(structure):
    """``structure`` with each ``LocalResults`` cut to this worker's components."""
    return jax.tree_util.tree_map(
        lambda x: x.local() if isinstance(x, LocalResults) else x,
        structure,
        is_leaf=lambda x: isinstance(x, LocalResults),
    )
