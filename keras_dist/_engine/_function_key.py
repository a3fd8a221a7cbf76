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
import operator
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
      so a closure over ``[model, optimizer]`` made afresh is the same function),
      and the module globals its code reads now, compared the same way
      (``GlobalReads``): a program traced with ``scale = 1.0`` is not the one
      for ``scale = 2.0``, as TF's eager ``run`` and fresh ``tf.function`` see it.
    * A bound method (made afresh at every attribute access) is its function,
      the object it is bound to and the globals the function reads.
    * Any other callable is itself, held weakly.
    """

    __slots__ = ("_parts", "_hash", "code")

    def __init__(self, fn):
        if isinstance(fn, types.MethodType):
            parts = (_identity(fn.__func__), _identity(fn.__self__))
            if isinstance(fn.__func__, types.FunctionType):
                parts += (global_reads(fn.__func__).part(),)
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
        and last.reads.part() is last.reads_part
    ):
        return last.key
    key = FunctionKey(fn)
    held = _held(captured) if isinstance(key.parts[0], _Value) else None
    if held is not None:
        reads = global_reads(fn)
        _last_key = _KeptKey(fn.__code__, fn.__globals__, held, reads, reads.part(), key)
    return key


class _KeptKey(NamedTuple):
    code: object
    globals: dict
    captured: tuple  # each captured object as an ``_Identity``
    reads: "GlobalReads"
    reads_part: object  # the globals' part of ``key`` (the same object while they hold)
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
    parts.append(global_reads(fn).part())
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


class GlobalReads:
    """The module globals a function's code reads, as a part of its key.

    Its code's names (nested functions' and lambdas' included) that are globals of
    its module, and so are the globals read by the functions of the same module it
    reads (a helper's constant counts). ``part()`` compares their values now as a
    captured object is compared; while every value is the very object it was, it
    is the same part object as before (a loop's step pays a dictionary look-up a
    name).

    >>> import types
    >>> module = {"scale": 1.0}
    >>> fn = types.FunctionType((lambda x: x * scale).__code__, module)
    >>> reads = GlobalReads(fn)
    >>> first = reads.part()
    >>> reads.part() is first
    True
    >>> module["scale"] = 2.0
    >>> reads.part() == first
    False
    """

    __slots__ = ("_names", "_values", "_part")

    def __init__(self, fn):
        self._names = _global_names(fn)
        self._values = None
        self._part = None

    def part(self):
        """The values of the globals read now, as one comparable part."""
        values = tuple(namespace.get(name, _UNSET) for namespace, name in self._names)
        last = self._values
        if last is not None and all(map(operator.is_, values, last)):
            return self._part
        part = _Contents(tuple, None, tuple(_global_part(value) for value in values))
        # A list or dict may change in place: compared by what it holds on every call.
        mutable = any(isinstance(value, (list, dict)) for value in values)
        self._values, self._part = (None if mutable else values), part
        return part


_UNSET = object()  # a global not (yet) defined
_MAX_HELPERS = 32  # same-module functions followed for the globals they read


def _global_part(value):
    part = _part(value)
    return part if part is not _UNRECOGNISABLE else _Identity(value, weak=False)


def global_reads(fn) -> GlobalReads:
    """``fn``'s ``GlobalReads``, made once per code and module."""
    key = (fn.__code__, id(fn.__globals__))
    reads = _reads_by_code.get(key)
    if reads is None:
        if len(_reads_by_code) >= _MAX_READS:
            _reads_by_code.pop(next(iter(_reads_by_code)))
        reads = _reads_by_code[key] = GlobalReads(fn)
    return reads


_MAX_READS = 1024
_reads_by_code: dict = {}


def _global_names(fn) -> tuple:
    """``(module globals, name)`` for each global ``fn`` (and its module's functions it
    reads, transitively) may read."""
    namespace = fn.__globals__
    found, seen_code, pending = {}, set(), [fn.__code__]
    while pending and len(seen_code) < _MAX_HELPERS:
        code = pending.pop()
        if code in seen_code:
            continue
        seen_code.add(code)
        for name in _code_names(code):
            if name not in namespace or name in found:
                continue
            found[name] = (namespace, name)
            value = namespace[name]
            if isinstance(value, types.FunctionType) and value.__globals__ is namespace:
                pending.append(value.__code__)  # a helper of the same module
    return tuple(found.values())


def _code_names(code):
    """The names ``code`` and the code objects nested in it load (globals among them)."""
    yield from code.co_names
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            yield from _code_names(const)


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
