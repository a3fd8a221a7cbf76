"""What a function reads from Python besides its arguments, as a part of its program's key.

TF's ``strategy.run`` outside ``tf.function`` runs eagerly, and a new ``tf.function``
traces anew: each sees the Python values its code reads now. keras_dist compiles
``run`` and keeps the program, so the program's key holds those values:

* the module globals the function's code names (its nested functions' and lambdas'
  code included), and those the same module's functions it names read in turn;
* the scalar attributes (numbers, strings, enums, ``None``) its code names of the
  objects it reaches: the objects it captures, the object a method is bound to and
  the objects among those globals (``self.scale``, ``config.scale``).

A value is compared as a key part (``_key_parts``). Reading the values is a
dictionary look-up a name, and while each is the very object it was, the part is the
same object as before: a loop's step pays no more.

>>> import types
>>> module = {"scale": 1.0}
>>> fn = types.FunctionType((lambda x: x * scale).__code__, module)
>>> reads = global_reads(fn)
>>> first = reads.part()
>>> reads.part() is first
True
>>> module["scale"] = 2.0
>>> reads.part() == first
False
"""

import enum
import inspect
import itertools
import operator
import types
import weakref

import numpy as np

from keras_dist._engine._key_parts import Contents
from keras_dist._engine._key_parts import static_key

_SCALARS = (bool, int, float, complex, str, bytes, type(None), enum.Enum, np.generic)
_UNSET = object()  # a name not (yet) defined
_MAX_HELPERS = 32  # same-module functions followed for the globals they read
_MAX_READS = 1024  # functions whose global reads are kept


class Slots:
    """Named values whose values now form one key part: ``(module globals, name)`` slots,
    read together, and ``(object, name)`` slots of the objects' attributes.

    Nothing here keeps an object alive: an object is held weakly (never its namespace,
    which would keep what it holds), and so is each value last read, but for numbers,
    strings and other values that cannot be (held as they are).
    """

    __slots__ = ("_names", "_readers", "_objects", "_held", "_part")

    def __init__(self, globals_slots=(), object_slots=()):
        namespaces = {}
        for namespace, name in globals_slots:
            namespaces.setdefault(id(namespace), (namespace, []))[1].append(name)
        # One C-level read of all of a namespace's names (``itemgetter``): a step's cost.
        self._readers = [_reader(namespace, names) for namespace, names in namespaces.values()]
        self._objects = tuple((weakref.ref(obj), name) for obj, name in object_slots)
        self._names = tuple(name for _, names in namespaces.values() for name in names)
        self._names += tuple(name for _, name in self._objects)
        self._held = None  # how to get each value last read back (``_holder``)
        self._part = None

    @property
    def names(self) -> tuple:
        """The names read, in the order of ``values``."""
        return self._names

    @property
    def values(self) -> tuple:
        """The slots' values now."""
        values = ()
        for read in self._readers:
            values += read()
        if self._objects:
            values += tuple(_attribute(ref, name) for ref, name in self._objects)
        return values

    def part(self, values=None):
        """The slots' values now (or ``values``) as one comparable part."""
        if not self._names:
            return _NOTHING_READ
        values = self.values if values is None else values
        held = self._held
        if held is not None and all(map(operator.is_, values, map(_CALL, held))):
            return self._part
        part = Contents(tuple, self._names, tuple(static_key(value) for value in values))
        holders = tuple(_holder(value) for value in values)
        self._held = None if None in holders else holders
        self._part = part
        return part


_CALL = operator.methodcaller("__call__")


def _holder(value):
    """A callable giving ``value`` back (held weakly where it can be), or ``None`` for a
    list, dict or tuple: what it holds may change, so it is compared anew every call."""
    if isinstance(value, (list, dict, tuple)):
        return None
    try:
        return weakref.ref(value)
    except TypeError:
        return itertools.repeat(value).__next__  # (a number or string: held as it is)


def _attribute(ref, name):
    obj = ref()
    return _UNSET if obj is None else getattr(obj, name, _UNSET)


def _reader(namespace, names):
    get = operator.itemgetter(*names)

    def read():
        try:
            return (get(namespace),) if len(names) == 1 else get(namespace)
        except KeyError:  # (a name deleted, or not yet defined)
            return tuple(namespace.get(name, _UNSET) for name in names)

    return read


_NOTHING_READ = Contents(tuple, (), ())


class GlobalReads:
    """A function's module globals (and the scalar attributes its code names of the objects
    among them), made once per code and module by ``global_reads``."""

    __slots__ = ("names", "_globals", "_attributes", "_last")

    def __init__(self, fn):
        self.names, slots = _global_names(fn)
        self._globals = Slots(globals_slots=slots)
        self._attributes = None  # for the objects the globals held when last read
        self._last = (None, None, None)  # (globals' part, attributes' part, both)

    def part(self):
        """The globals' values now (and those attributes'), as one comparable part."""
        if self._attributes is not None and not self._globals.names:
            return self._last[2]  # (no global read: nothing can change)
        values = self._globals.values
        globals_part = self._globals.part(values)
        last_globals, last_attributes, last = self._last
        if self._attributes is None or globals_part is not last_globals:
            self._attributes = attribute_slots(self.names, values)
        attributes_part = self._attributes.part()
        if globals_part is last_globals and attributes_part is last_attributes:
            return last
        both = Contents(tuple, None, (globals_part, attributes_part))
        self._last = (globals_part, attributes_part, both)
        return both


def global_reads(fn) -> GlobalReads:
    """``fn``'s ``GlobalReads``, made once per code and module."""
    key = (fn.__code__, id(fn.__globals__))
    reads = _reads_by_code.get(key)
    if reads is None:
        if len(_reads_by_code) >= _MAX_READS:
            _reads_by_code.pop(next(iter(_reads_by_code)))
        reads = _reads_by_code[key] = GlobalReads(fn)
    return reads


_reads_by_code: dict = {}


def attribute_slots(names, objects) -> Slots:
    """The slots of the scalar attributes named in ``names`` of each of ``objects``."""
    slots = []
    for obj in objects:
        if isinstance(obj, (type, types.FunctionType, *_SCALARS)):
            continue  # (a class's or a function's attributes are its code's, not state)
        try:
            weakref.ref(obj)
        except TypeError:
            continue  # (not to be held weakly: its attributes are not followed)
        # Looked up without running properties or other descriptors (their values are
        # the code's, and may cost anything): plain attributes only.
        slots += [
            (obj, name)
            for name in names
            if isinstance(inspect.getattr_static(obj, name, _UNSET), _SCALARS)
        ]
    return Slots(object_slots=slots)


def _global_names(fn) -> tuple:
    """The names ``fn``'s code (and its module's functions it names) loads, and the
    ``(module globals, name)`` slot of each that is a global."""
    namespace = fn.__globals__
    names, found, seen_code, pending = set(), {}, set(), [fn.__code__]
    while pending and len(seen_code) < _MAX_HELPERS:
        code = pending.pop()
        if code in seen_code:
            continue
        seen_code.add(code)
        for name in _code_names(code):
            names.add(name)
            if name not in namespace or name in found:
                continue
            found[name] = (namespace, name)
            value = namespace[name]
            if isinstance(value, types.FunctionType) and value.__globals__ is namespace:
                pending.append(value.__code__)  # a helper of the same module
    return frozenset(names), tuple(found.values())


def _code_names(code):
    """The names ``code`` and the code objects nested in it load (globals among them)."""
    yield from code.co_names
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            yield from _code_names(const)
