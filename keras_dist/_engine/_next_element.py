"""Iterator arguments of a ``kd.function``: each call's next elements become program inputs.

TF's ``train_step(iterator)`` with ``next(iterator)`` inside compiles to a
program that reads the iterator, and so does its way of running several steps
a call (``for _ in tf.range(steps): strategy.run(step_fn, args=(next(iterator),))``,
ported with a Python ``range``). Here the elements are read before the call and
passed as inputs; inside the trace the iterator argument is a ``_NextElements``
that hands them out in order. How many a call takes is learned from a trace
(``ReadsMore``) and remembered per signature of the other arguments: a call
then reads exactly that many, and a program of ``k`` steps is one dispatch.
A loop on ``get_next_as_optional`` raises ``InputReadInTrace``: the function
then runs its Python on each call, reading the real iterator.
"""

import jax
import numpy as np

from keras_dist._context import InputReadInTrace
from keras_dist._context import current_function_trace
from keras_dist._engine._key_parts import static_key
from keras_dist._input import DistributedIterator
from keras_dist._jax_trace import refuse_foreign_trace
from keras_dist._keras import KerasVariable
from keras_dist._values import DistributedValues


def is_argument_leaf(x):
    """The leaves of a ``kd.function``'s arguments: distributed values and variables whole."""
    return x is None or isinstance(x, (DistributedValues, KerasVariable))


# Elements a call reads from its iterator arguments, at most: each is a step of the
# program, unrolled (TF's `tf.range` loop is one loop); a trace that takes more (a
# loop to the end of the data) runs as Python.
MAX_READS = 100


class TooManyReads(InputReadInTrace):
    """A trace took more than ``MAX_READS`` elements from an iterator argument."""


class ReadsMore(BaseException):  # noqa: N818 (not an error: the call starts again)
    """A trace took another number of elements from its iterator arguments than were read.

    ``counts``: how many each iterator argument took, in the arguments' order.
    """

    def __init__(self, counts: tuple):
        super().__init__(counts)
        self.counts = counts


class ReadCounts:
    """How many elements a call takes from each iterator argument, learned from a trace,
    by the function's other Python arguments (a ``steps`` count among them)."""

    AS_PYTHON = object()  # calls with those arguments run as Python

    def __init__(self):
        self._counts: dict = {}

    @staticmethod
    def key(leaves, treedef):
        """The key of a call's flattened arguments: all but the iterators and arrays."""
        statics = [static_key(x) for x in leaves if not isinstance(x, _NOT_STATIC)]
        return treedef, tuple(statics)

    def get(self, key):
        """The counts learned for ``key`` (``None``: one each, until a trace says)."""
        return self._counts.get(key)

    def learn(self, key, counts) -> None:
        self._counts[key] = counts


_NOT_STATIC = (DistributedIterator, DistributedValues, jax.Array, np.ndarray, np.generic)


@jax.tree_util.register_pytree_node_class
class _NextElements:
    """An iterator argument inside a ``kd.function``: ``next()`` gives the elements read for it.

    Past them it counts the calls and gives the last one again (the trace is
    then done again with as many read: ``check_reads``), up to ``MAX_READS``.
    """

    def tree_flatten(self):
        return tuple(self._elements), len(self._elements)

    @classmethod
    def tree_unflatten(cls, _, children):
        return cls(list(children))

    def __init__(self, elements: list):
        self._elements = elements
        self.taken = 0

    @property
    def given(self) -> int:
        """How many elements were read for the call."""
        return len(self._elements)

    def __iter__(self):
        return self

    def __next__(self):
        trace = current_function_trace()
        if trace is not None and trace.jax_trace is not None:
            refuse_foreign_trace("`next(iterator)`", trace.jax_trace)
        if not self._elements:
            raise InputReadInTrace()  # (a stand-in needs one element read)
        if self.taken >= MAX_READS:
            raise TooManyReads()  # (`for x in iterator` would never end here)
        element = self._elements[min(self.taken, len(self._elements) - 1)]
        self.taken += 1
        return element

    get_next = __next__

    def get_next_as_optional(self):
        raise InputReadInTrace()  # a loop to the end of the data: read by the Python


def check_reads(structure) -> None:
    """Raises ``ReadsMore`` if an iterator argument in ``structure`` (as a trace got it)
    handed out another number of elements than it was given."""
    readers = [
        x
        for x in jax.tree_util.tree_leaves(structure, is_leaf=_is_reader)
        if isinstance(x, _NextElements)
    ]
    counts = tuple(r.taken for r in readers)
    if counts != tuple(r.given for r in readers):
        raise ReadsMore(counts)


def _is_reader(x):
    return isinstance(x, _NextElements) or is_argument_leaf(x)


def with_next_elements(structure, read_ahead: list, counts=None):
    """``structure`` with each distributed iterator in it replaced by its next elements.

    ``counts[i]`` elements for the ``i``-th iterator (one each if ``None``).
    Appends ``(iterator, element)`` to ``read_ahead`` for each element read;
    past the end puts them back and raises ``StopIteration``.
    """
    leaves, treedef = jax.tree_util.tree_flatten(structure, is_leaf=is_argument_leaf)
    position = 0
    for i, leaf in enumerate(leaves):
        if isinstance(leaf, DistributedIterator):
            count = 1 if counts is None else counts[position]
            position += 1
            elements = []
            for _ in range(count):
                try:
                    element = leaf.get_next()  # past the end: OutOfRangeError, as TF's call
                except StopIteration:
                    put_back(read_ahead)  # the call does not happen: unread
                    raise
                read_ahead.append((leaf, element))
                elements.append(element)
            leaves[i] = _NextElements(elements)
    return jax.tree_util.tree_unflatten(treedef, leaves)


def put_back(read_ahead: list) -> None:
    """Returns the elements read ahead to their iterators, the first read next again."""
    for iterator, element in reversed(read_ahead):
        iterator.put_back(element)
    read_ahead.clear()
