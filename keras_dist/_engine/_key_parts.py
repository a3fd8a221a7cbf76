"""The parts a cache key is made of: Python values compared as a program depends on them.

A program traced with a Python value baked in is the program for that value only:
numbers, strings and other hashable values compare by value (``Value``), objects by
identity, held weakly where they can be (``Identity``: a dropped model is freed, and a
new object at a freed object's address never matches), and lists, tuples and dicts by
what they hold now (``Contents``). A part is ``alive`` while what it refers to is.

>>> key_part(3) == key_part(3), key_part([1, "a"]) == key_part([1, "a"])
(True, True)
"""

import math
import weakref

UNRECOGNISABLE = object()  # a value no part can stand for (unhashable, not weakly held)


_MAX_DEPTH = 4  # nested containers this deep are compared by what they hold


def key_part(value, depth=0):
    """``value`` as a key part, or ``UNRECOGNISABLE``."""
    if isinstance(value, (list, tuple, dict)) and depth < _MAX_DEPTH:
        return _contents(value, depth)
    try:
        return Identity(value)
    except TypeError:
        pass
    return Value(value) if _hashable(value) else UNRECOGNISABLE


def _contents(container, depth):
    """A list, tuple or dict (neither weakly referenceable nor, mostly, hashable) as what it
    holds now, each item as a captured object would be."""
    keys = tuple(container) if isinstance(container, dict) else None
    items = container.values() if keys is not None else container
    parts = tuple(key_part(item, depth + 1) for item in items)
    if any(p is UNRECOGNISABLE for p in parts) or (keys is not None and not _hashable(keys)):
        return UNRECOGNISABLE
    return Contents(type(container), keys, parts)


def _hashable(value) -> bool:
    try:
        hash(value)
    except TypeError:
        return False
    return True


class Contents:
    """A container compared by its type, its keys (a dict's) and the parts of what it holds."""

    __slots__ = ("_key", "_parts", "_hash")

    def __init__(self, kind, keys, parts: tuple):
        self._parts = parts
        self._key = (kind, keys, parts)
        self._hash = hash(self._key)  # (a program's key is hashed at every call)

    @property
    def key(self) -> tuple:
        """What it is compared by: the container's type, its keys and its parts."""
        return self._key

    @property
    def alive(self) -> bool:
        return all(part.alive for part in self._parts)

    def __hash__(self):
        return self._hash

    def __eq__(self, other):
        return isinstance(other, Contents) and (
            self is other or (self._hash == hash(other) and self._key == other.key)
        )


def static_key(value):
    """A Python argument in a cache key: by value when hashable, else by (weak) identity.

    An object is compared by identity and held weakly where it can be, so a new
    object that reuses a freed object's address never matches its entry.

    >>> static_key(3) == static_key(3), static_key(0.0) == static_key(-0.0)
    (True, False)
    """
    part = key_part(value)
    return part if part is not UNRECOGNISABLE else Identity(value, weak=False)


def identity_part(value):
    """``value`` by identity: weakly held where it can be, strongly otherwise."""
    try:
        return Identity(value)
    except TypeError:  # e.g. an instance with __slots__: held strongly instead
        return Identity(value, weak=False)


class Identity:
    """An object compared by identity; weakly held where it can be."""

    __slots__ = ("_ref", "_id")

    def __init__(self, value, weak=True):
        self._id = id(value)
        self._ref = weakref.ref(value) if weak else (lambda: value)

    @property
    def referent(self):
        """The object, or ``None`` once it is gone."""
        return self._ref()

    @property
    def alive(self) -> bool:
        return self._ref() is not None

    def __hash__(self):
        return self._id

    def __eq__(self, other):
        if not isinstance(other, Identity) or self._id != hash(other):
            return False
        mine = self._ref()
        return mine is not None and mine is other.referent


class Value:
    """A hashable value compared by type and equality (numbers, strings, code)."""

    __slots__ = ("_value",)
    alive = True

    def __init__(self, value):
        self._value = value

    @property
    def value(self):
        """The value it stands for."""
        return self._value

    def __hash__(self):
        return hash((type(self._value), self._value))

    def __eq__(self, other):
        if not isinstance(other, Value):
            return False
        theirs = other.value
        return (
            type(self._value) is type(theirs)
            and self._value == theirs
            and _same_sign(self._value, theirs)
        )


def _same_sign(a, b) -> bool:
    """0.0 and -0.0 are equal but not the same argument (``1 / x`` differs)."""
    if isinstance(a, float):
        return math.copysign(1.0, a) == math.copysign(1.0, b)
    return True
