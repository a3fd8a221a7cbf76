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

import types
from typing import NamedTuple

from keras_dist._engine._key_parts import UNRECOGNISABLE
from keras_dist._engine._key_parts import Identity
from keras_dist._engine._key_parts import Value
from keras_dist._engine._key_parts import identity_part
from keras_dist._engine._key_parts import key_part
from keras_dist._engine._python_reads import attribute_slots
from keras_dist._engine._python_reads import global_reads


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
      and what its code reads from Python now, compared the same way
      (``_python_reads``: module globals, and the scalar attributes it names of the
      objects it reaches): a program traced with ``scale = 1.0`` is not the one
      for ``scale = 2.0``, as TF's eager ``run`` and fresh ``tf.function`` see it.
    * A bound method (made afresh at every attribute access) is its function,
      the object it is bound to and what the function reads (``self.scale``).
    * Any other callable is itself, held weakly.
    """

    __slots__ = ("_parts", "_hash", "code", "reads")

    def __init__(self, fn):
        self.reads = None  # ``(global reads, attribute slots)`` the key holds the parts of
        if isinstance(fn, types.MethodType):
            parts = (identity_part(fn.__func__), identity_part(fn.__self__))
            if isinstance(fn.__func__, types.FunctionType):
                self.reads = _reads(fn.__func__, [fn.__self__])
                parts += _reads_parts(self.reads)
            self.code = MethodCode(getattr(fn.__func__, "__code__", fn.__func__), id(fn.__self__))
        elif isinstance(fn, types.FunctionType):
            captured = _captured(fn)
            self.reads = _reads(fn, captured)
            parts = _function_parts(fn, captured, self.reads)
            self.code = fn.__code__
        else:
            parts = (identity_part(fn),)
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

    A key is worth 10 µs of a step's host time to make. The last key of a plain
    function (of its code) or a bound method is kept while the function asked for has
    the same code and globals (or function and object), captures the very same objects
    (held weakly) and reads the same Python values: a loop's step function, or the
    closure TF's tutorials make afresh each step. A function capturing a list, tuple or
    dict (whose contents may change) gets a new key.

    >>> def make(scale):
    ...     def step(x):
    ...         return x * scale
    ...     return step
    >>> key_of(make(2)) is key_of(make(2)), key_of(make(2)) == key_of(make(3))
    (True, False)
    """
    if isinstance(fn, types.MethodType):
        function, owner, captured = fn.__func__, None, (fn.__self__,)  # (held weakly)
    elif isinstance(fn, types.FunctionType):
        function, owner, captured = fn.__code__, fn.__globals__, _captured(fn)
    else:
        return FunctionKey(fn)
    last = _kept_keys.get(id(function))
    if (
        last is not None
        and last.function is function
        and last.owner is owner
        and len(last.captured) == len(captured)
        and all(map(_is_held, last.captured, captured))
        and _reads_parts(last.key.reads) == last.reads_parts
    ):
        return last.key
    key = FunctionKey(fn)
    comparable = key.reads is not None and (
        isinstance(fn, types.MethodType) or isinstance(key.parts[0], Value)
    )
    held = _held(captured) if comparable else None
    if held is not None:
        if len(_kept_keys) >= _MAX_KEPT and id(function) not in _kept_keys:
            _kept_keys.pop(next(iter(_kept_keys)))
        _kept_keys[id(function)] = _KeptKey(function, owner, held, _reads_parts(key.reads), key)
    return key


class _KeptKey(NamedTuple):
    function: object  # a plain function's code, or a method's function
    owner: object  # the plain function's globals (``None`` for a method)
    captured: tuple  # each captured object (a method's object) as an ``Identity``
    reads_parts: tuple  # the key's parts of what it read (the same objects while they hold)
    key: FunctionKey


# The last key of each of a few functions (a loop's train and test steps alternate).
_kept_keys: dict = {}  # id(function) -> _KeptKey
_MAX_KEPT = 8


def _reads(fn, objects) -> tuple:
    """``fn``'s global reads and the slots of the scalar attributes it names of ``objects``."""
    reads = global_reads(fn)
    return reads, attribute_slots(reads.names, objects)


def _reads_parts(reads) -> tuple:
    global_reads_, attributes = reads
    return global_reads_.part(), attributes.part()


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
    return tuple(identity_part(value) for value in captured)


def _is_held(held, value) -> bool:
    return held.referent is value


def _function_parts(fn, captured, reads) -> tuple:
    parts = [Value(fn.__code__), Identity(fn.__globals__, weak=False), *_reads_parts(reads)]
    for value in captured:
        part = key_part(value)
        if part is UNRECOGNISABLE:
            return (identity_part(fn),)  # not comparable: the function object itself
        parts.append(part)
    return tuple(parts)


def _filled(cell) -> bool:
    try:
        cell.cell_contents  # noqa: B018 -- an empty cell raises ValueError
    except ValueError:
        return False
    return True
