"""``FunctionKey``: a replica function in a cache key, recognised and held weakly.

The compiled engine caches one program per replica function and input
signature. Two things matter for that key:

* It must not keep the function alive: a cache that held the functions (and
  the models they close over) would keep every model ever trained.
* A function re-created on every call with the same code and the same captured
  objects is the same function. TF tutorials define ``step_fn`` inside
  ``train_step``, so every call passes a new closure to ``strategy.run``;
  ``tf.function`` hid that, and a key on the function object would trace and
  compile every step again.

>>> def make():
...     def step():
...         return 1
...     return step
>>> FunctionKey(make()) == FunctionKey(make())
True
"""

import math
import types
import weakref
from typing import NamedTuple

_UNRECOGNISABLE = object()


class MethodCode(NamedTuple):
    """What a bound method's traces are counted under: its code and its object.

    Each object's method is a function of its own: a script that trains several
    models traces each model's steps once, which is not retracing.
    """

    code: object
    instance: int  # id() of the object (its traces are its own)

    @property
    def co_qualname(self) -> str:
        return getattr(self.code, "co_qualname", str(self.code))


class FunctionKey:
    """A callable as a cache key: its code and what it captures, not the object itself.

    * A plain function or lambda is its code, globals, defaults and the objects
      its closure cells hold (by identity, held weakly; numbers, strings and
      other hashable values by value; a list, tuple or dict by what it holds,
      so a closure over ``[model, optimizer]`` made afresh is the same function).
    * A bound method (made afresh at every attribute access) is its function
      and the object it is bound to.
    * Any other callable is itself, held weakly.
    """

    __slots__ = ("_parts", "_hash", "code")

    def __init__(self, fn):
        if isinstance(fn, types.MethodType):
            parts = (_identity(fn.__func__), _identity(fn.__self__))
            self.code = MethodCode(getattr(fn.__func__, "__code__", fn.__func__), id(fn.__self__))
        elif isinstance(fn, types.FunctionType):
            parts = _function_parts(fn)
            self.code = fn.__code__
        else:
            parts = (_identity(fn),)
            self.code = type(fn)
        self._parts = parts
        self._hash = hash(parts)

    @property
    def parts(self) -> tuple:
        """What the key compares: the function's code and what it captures, each a part."""
        return self._parts

    @property
    def alive(self) -> bool:
        """False once an object the key refers to is gone (the entry can never match)."""
        return all(part.alive for part in self._parts)

    def __hash__(self):
        return self._hash

    def __eq__(self, other):
        return (
            isinstance(other, FunctionKey)
            and self._hash == hash(other)
            and self.alive
            and self._parts == other.parts
        )


def key_of(fn) -> FunctionKey:
    """``FunctionKey(fn)``, made once for a loop that passes the same function each step.

    A key is worth 10 µs of a step's host time to make. The last plain
    function's key is kept while the function asked for has the same code and
    globals and captures the very same objects (held weakly): a loop's step
    function, or the closure TF's tutorials make afresh each step. A function
    capturing a list, tuple or dict (whose contents may change) gets a new key.

    >>> def make(scale):
    ...     def step(x):
    ...         return x * scale
    ...     return step
    >>> key_of(make(2)) is key_of(make(2)), key_of(make(2)) == key_of(make(3))
    (True, False)
    """
    global _last_key
    if not isinstance(fn, types.FunctionType):
        return FunctionKey(fn)
    captured = _captured(fn)
    last = _last_key
    if (
        last is not None
        and last.code is fn.__code__
        and last.globals is fn.__globals__
        and len(last.captured) == len(captured)
        and all(map(_is_held, last.captured, captured))
    ):
        return last.key
    key = FunctionKey(fn)
    held = _held(captured) if isinstance(key.parts[0], _Value) else None
    if held is not None:
        _last_key = _KeptKey(fn.__code__, fn.__globals__, held, key)
    return key


class _KeptKey(NamedTuple):
    code: object
    globals: dict
    captured: tuple  # each captured object as an ``_Identity``
    key: FunctionKey


_last_key = None


def _captured(fn) -> list:
    """What ``fn`` captures, as its key compares it: closure cells, then defaults."""
    captured = [cell.cell_contents for cell in (fn.__closure__ or ()) if _filled(cell)]
    captured += list(fn.__defaults__ or ())
    captured += sorted((fn.__kwdefaults__ or {}).items(), key=lambda item: item[0])
    return captured


def _held(captured):
    """Each captured object by identity (weakly where it can be); ``None`` if one is a
    container."""
    if any(isinstance(value, (list, tuple, dict)) for value in captured):
        return None
    return tuple(_identity(value) for value in captured)


def _is_held(held, value) -> bool:
    return held.referent is value


def _function_parts(fn) -> tuple:
    captured = _captured(fn)
    parts = [_Value(fn.__code__), _Identity(fn.__globals__, weak=False)]
    for value in captured:
        part = _part(value)
        if part is _UNRECOGNISABLE:
            return (_identity(fn),)  # not comparable: the function object itself
        parts.append(part)
    return tuple(parts)


def _filled(cell) -> bool:
    try:
        cell.cell_contents  # noqa: B018 -- an empty cell raises ValueError
    except ValueError:
        return False
    return True


_MAX_DEPTH = 4  # nested containers this deep are compared by what they hold


def _part(value, depth=0):
    if isinstance(value, (list, tuple, dict)) and depth < _MAX_DEPTH:
        return _contents(value, depth)
    try:
        return _Identity(value)
    except TypeError:
        pass
    return _Value(value) if _hashable(value) else _UNRECOGNISABLE


def _contents(container, depth):
    """A list, tuple or dict (neither weakly referenceable nor, mostly, hashable) as what it
    holds now, each item as a captured object would be."""
    keys = tuple(container) if isinstance(container, dict) else None
    items = container.values() if keys is not None else container
    parts = tuple(_part(item, depth + 1) for item in items)
    if any(p is _UNRECOGNISABLE for p in parts) or (keys is not None and not _hashable(keys)):
        return _UNRECOGNISABLE
    return _Contents(type(container), keys, parts)


def _hashable(value) -> bool:
    try:
        hash(value)
    except TypeError:
        return False
    return True


class _Contents:
    """A container compared by its type, its keys (a dict's) and the parts of what it holds."""

    __slots__ = ("_key", "_parts")

    def __init__(self, kind, keys, parts: tuple):
        self._parts = parts
        self._key = (kind, keys, parts)

    @property
    def key(self) -> tuple:
        """What it is compared by: the container's type, its keys and its parts."""
        return self._key

    @property
    def alive(self) -> bool:
        return all(part.alive for part in self._parts)

    def __hash__(self):
        return hash(self._key)

    def __eq__(self, other):
        return isinstance(other, _Contents) and self._key == other.key


def static_key(value):
    """A Python argument in a cache key: by value when hashable, else by (weak) identity.

    An object is compared by identity and held weakly where it can be, so a new
    object that reuses a freed object's address never matches its entry.

    >>> static_key(3) == static_key(3), static_key(0.0) == static_key(-0.0)
    (True, False)
    """
    part = _part(value)
    return part if part is not _UNRECOGNISABLE else _Identity(value, weak=False)


def _identity(value):
    try:
        return _Identity(value)
    except TypeError:  # e.g. an instance with __slots__: held strongly instead
        return _Identity(value, weak=False)


class _Identity:
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
        if not isinstance(other, _Identity) or self._id != hash(other):
            return False
        mine = self._ref()
        return mine is not None and mine is other.referent


class _Value:
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
        if not isinstance(other, _Value):
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
