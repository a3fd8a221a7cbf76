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
from keras_dist._engine._python_reads import Slots
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

    __slots__ = ("_parts", "_hash", "code")

    def __init__(self, fn):
        if isinstance(fn, types.MethodType):
            parts = (identity_part(fn.__func__), identity_part(fn.__self__))
            if isinstance(fn.__func__, types.FunctionType):
                reads = global_reads(fn.__func__)
                parts += (reads.part(), attribute_slots(reads.names, [fn.__self__]).part())
            self.code = MethodCode(getattr(fn.__func__, "__code__", fn.__func__), id(fn.__self__))
        elif isinstance(fn, types.FunctionType):
            parts = _function_parts(fn)
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
    if isinstance(fn, types.MethodType):
        return _method_key(fn)
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
        and last.attributes.part() is last.attributes_part
    ):
        return last.key
    key = FunctionKey(fn)
    held = _held(captured) if isinstance(key.parts[0], Value) else None
    if held is not None:
        reads = global_reads(fn)
        attributes = attribute_slots(reads.names, captured)
        _last_key = _KeptKey(
            fn.__code__, fn.__globals__, held, reads, reads.part(), attributes,
            attributes.part(), key,
        )  # fmt: skip
    return key


class _KeptKey(NamedTuple):
    code: object
    globals: dict
    captured: tuple  # each captured object as an ``Identity``
    reads: object  # the function's ``GlobalReads``
    reads_part: object  # the globals' part of ``key`` (the same object while they hold)
    attributes: Slots  # the captured objects' scalar attributes the code names
    attributes_part: object
    key: FunctionKey


_last_key = None


class _KeptMethodKey(NamedTuple):
    func: object
    instance: object  # the ``Identity`` of the object the method is bound to
    reads: object
    reads_part: object
    attributes: Slots
    attributes_part: object
    key: FunctionKey


_last_method_key = None


def _method_key(fn) -> FunctionKey:
    """``FunctionKey(fn)`` of a bound method (made afresh at every attribute access), kept
    while the next has the same function and object and reads the same values."""
    global _last_method_key
    last = _last_method_key
    if (
        last is not None
        and last.func is fn.__func__
        and last.instance.referent is fn.__self__
        and last.reads.part() is last.reads_part
        and last.attributes.part() is last.attributes_part
    ):
        return last.key
    key = FunctionKey(fn)
    if isinstance(fn.__func__, types.FunctionType):
        reads = global_reads(fn.__func__)
        attributes = attribute_slots(reads.names, [fn.__self__])
        _last_method_key = _KeptMethodKey(
            fn.__func__, identity_part(fn.__self__), reads, reads.part(), attributes,
            attributes.part(), key,
        )  # fmt: skip
    return key


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


def _function_parts(fn) -> tuple:
    captured = _captured(fn)
    reads = global_reads(fn)
    parts = [Value(fn.__code__), Identity(fn.__globals__, weak=False), reads.part()]
    parts.append(attribute_slots(reads.names, captured).part())
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
