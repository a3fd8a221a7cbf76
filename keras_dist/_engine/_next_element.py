"""Iterator arguments of a ``kd.function``: each call's next element becomes a program input.

TF's ``train_step(iterator)`` with ``next(iterator)`` inside compiles to a
program that reads the iterator. Here the element is read before the call and
passed as an input; inside the trace the iterator argument is a
``_NextElement`` that hands it out once. Reading more (a second ``next``, a
loop on ``get_next_as_optional``) raises ``InputReadInTrace``: the function
then runs its Python on each call, reading the real iterator.
"""

import jax

from keras_dist._context import InputReadInTrace
from keras_dist._input import DistributedIterator
from keras_dist._keras import KerasVariable
from keras_dist._values import DistributedValues


def is_argument_leaf(x):
    """The leaves of a ``kd.function``'s arguments: distributed values and variables whole."""
    return x is None or isinstance(x, (DistributedValues, KerasVariable))


@jax.tree_util.register_pytree_node_class
class _NextElement:
    """An iterator argument inside a ``kd.function``: ``next()`` gives the element read for it."""

    def tree_flatten(self):
        return (self._element,), None

    @classmethod
    def tree_unflatten(cls, _, children):
        return cls(children[0])

    def __init__(self, element):
        self._element = element
        self._taken = False

    def __iter__(self):
        return self

    def __next__(self):
        if self._taken:
            # A second element in one call (a loop of steps): read by the Python.
            raise InputReadInTrace()
        self._taken = True
        return self._element

    get_next = __next__

    def get_next_as_optional(self):
        raise InputReadInTrace()  # a loop to the end of the data: read by the Python


def with_next_elements(structure, read_ahead: list):
    """``structure`` with each distributed iterator in it replaced by its next element.

    Appends ``(iterator, element)`` to ``read_ahead`` for each element read.
    """
    leaves, treedef = jax.tree_util.tree_flatten(structure, is_leaf=is_argument_leaf)
    for i, leaf in enumerate(leaves):
        if isinstance(leaf, DistributedIterator):
            try:
                element = leaf.get_next()  # past the end: OutOfRangeError, as TF's call
            except StopIteration:
                for iterator, read in read_ahead:  # the call does not happen: unread
                    iterator.put_back(read)
                raise
            read_ahead.append((leaf, element))
            leaves[i] = _NextElement(element)
    return jax.tree_util.tree_unflatten(treedef, leaves)
