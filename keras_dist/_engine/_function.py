"""``kd.function``: ``tf.function`` for code around ``strategy.run``, compiled whole.

A Python function that calls ``strategy.run``, ``strategy.reduce``, optimizer
and metric updates is traced once per input signature into one ``jax.jit``
program: each ``strategy.run`` inside becomes a ``shard_map`` of that program
(``run_inline``), every variable it touches is threaded through as explicit,
donated state, and a step costs one dispatch.

Variables are found by tracing: the first trace of a signature records the
variables the code reads, writes, or whose strategy runs a replica function,
and the function is traced again with them as state (as ``tf.function`` traces
again when a first call creates variables). Per-replica inputs of different
shapes (a partial last batch) run the Python function as it is: every
``strategy.run`` in it then compiles per shape on its own. An iterator
argument's next elements are read before the call and become inputs, as many
as the body takes (TF's loop of steps on ``next(iterator)`` is one program:
``_next_element.py``). A function that reads a distributed dataset or iterator
otherwise (a ``for`` loop over a dataset, ``get_next_as_optional``, an iterator
it closes over) runs as Python from then on: a program would keep the batches
its trace read.
"""

import collections
import collections.abc
import contextlib
import functools
import types
import weakref

import jax
import numpy as np

from keras_dist import _context
from keras_dist._capabilities import RemoteScheduling
from keras_dist._context import InputReadInTrace
from keras_dist._engine._function_key import FunctionKey
from keras_dist._engine._function_outputs import flatten_outputs
from keras_dist._engine._function_placement import for_trace
from keras_dist._engine._function_program import FunctionProgram
from keras_dist._engine._function_state import keep_sharding
from keras_dist._engine._function_state import state_value as _state_value
from keras_dist._engine._inline import FunctionScope
from keras_dist._engine._inline import FunctionTrace
from keras_dist._engine._key_parts import static_key
from keras_dist._engine._next_element import ReadCounts
from keras_dist._engine._next_element import ReadsMore
from keras_dist._engine._next_element import TooManyReads
from keras_dist._engine._next_element import check_reads
from keras_dist._engine._next_element import is_argument_leaf
from keras_dist._engine._next_element import put_back
from keras_dist._engine._next_element import with_next_elements
from keras_dist._engine._program_reuse import ProgramFingerprint
from keras_dist._engine._python_reads import global_reads
from keras_dist._engine._retracing import RetraceMonitor
from keras_dist._engine._state_layout import StateLayout
from keras_dist._engine._tensorflow_calls import explains_tensorflow_calls
from keras_dist._input import DistributedIterator
from keras_dist._input import EndOfInput
from keras_dist._jax_trace import current_trace
from keras_dist._keras import initialize_pending_variables
from keras_dist._keras import pending_variables
from keras_dist._values import DistributedValues
from keras_dist._values import Mirrored
from keras_dist._values import PerReplica
from keras_dist._values._variables import DistributedVariable
from keras_dist.config import _switches as _config

_MAX_TRACES = 6


# What stops a trace of the whole function; the function then runs its Python.
class OnParameterServers(Exception):
    """A ``kd.function`` uses variables held by parameter servers: no program holds them."""


_RUNS_AS_PYTHON = (
    InputReadInTrace,
    OnParameterServers,
    jax.errors.ConcretizationTypeError,  # `if x > 0:` on an input
    jax.errors.TracerIntegerConversionError,  # `range(steps)` of an input
)


class _BoundFunction:
    """A ``kd.function`` method of one instance (made at each attribute access)."""

    def __init__(self, function, instance):
        self._function = function
        self._instance = instance

    def __call__(self, *args, **kwargs):
        return self._function(self._instance, *args, **kwargs)

    def __reduce__(self):
        # As a bound method pickles: its instance and the method's name.
        return getattr, (self._instance, self._function.python_function.__name__)

    def experimental_get_tracing_count(self) -> int:
        """How many programs this method has built for this instance."""
        return self._function.experimental_get_tracing_count()


def _scheduled_on_workers() -> bool:
    # Under a parameter-server strategy the coordinator compiles what it schedules
    # (``coordinator.schedule``), and a function on the coordinator runs as Python.
    return isinstance(_context.get_strategy().extended, RemoteScheduling)


def _on_parameter_servers(variable) -> bool:
    return isinstance(variable, DistributedVariable) and isinstance(
        variable.distribute_strategy.extended, RemoteScheduling
    )


def _function_of(python_function, options):
    return Function(python_function, **options)


class Function:
    """A Python function compiled whole, once per input signature (``tf.function``).

    Use it as ``@kd.function`` or ``@kd.function(input_signature=...,
    jit_compile=..., reduce_retracing=...)`` (TF's arguments are accepted; the
    program is always compiled with XLA), on functions and on methods.

    >>> import numpy as np, keras, keras_dist as kd
    >>> strategy = kd.MirroredStrategy(["/cpu:0", "/cpu:1"])
    >>> with strategy.scope():
    ...     total = keras.Variable(0.0, aggregation="sum")
    >>> @kd.function
    ... def step(x):
    ...     def replica_fn(x):
    ...         total.assign_add(x.sum())
    ...         return x.sum()
    ...     return strategy.reduce("SUM", strategy.run(replica_fn, args=(x,)), axis=None)
    >>> (batch,) = strategy.experimental_distribute_dataset([np.ones(4, "float32")])
    >>> float(step(batch)), float(step(batch)), float(total.value)
    (4.0, 4.0, 8.0)
    >>> step.experimental_get_tracing_count()
    1
    """

    def __init__(self, python_function, **options):
        functools.update_wrapper(self, python_function)
        self.python_function = python_function
        self._options = options
        self._programs: collections.OrderedDict = collections.OrderedDict()
        self._state: list = []  # weak references to the variables found so far
        self._extendeds: list = []  # the strategies the last trace ran on
        self._tracing_count = 0
        self._retraces = RetraceMonitor()
        self._bound: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self._code = FunctionKey(python_function).code
        # The module globals the function reads: a program traced with other values
        # of them is not the one to run (``scale = 2.0`` after a trace with 1.0).
        self._globals = (
            global_reads(python_function)
            if isinstance(python_function, types.FunctionType)
            else None
        )
        # Set once a trace read a dataset or iterator itself: each call runs the Python.
        self._runs_as_python = False
        self._reads = ReadCounts()  # elements a call takes from its iterator arguments

    def __get__(self, instance, owner=None):
        if instance is None:
            return self
        function = self._bound.get(instance)
        if function is None:
            # Programs per instance, none of which holds the instance: it is an
            # argument of the program (a static one, referenced weakly).
            function = Function(self.python_function, **self._options)
            self._bound[instance] = function
        return _BoundFunction(function, instance)

    def __reduce__(self):
        # Pickled as its Python function (its programs stay here): a parameter-server
        # coordinator ships the functions it schedules, ``dataset_fn``s included.
        return _function_of, (self.python_function, self._options)

    def experimental_get_tracing_count(self) -> int:
        """How many programs this function has built (one per input signature)."""
        return self._tracing_count

    def __call__(self, *args, **kwargs):
        return self._call(args, kwargs)

    @explains_tensorflow_calls("A `kd.function`")
    def _call(self, args, kwargs, relearned=False):
        inside = _context.current_function_trace() is not None
        inside = inside or _context.current_frame().engine is not None  # in a replica's run
        if inside or _config.functions_run_eagerly() or _scheduled_on_workers():
            return self.python_function(*args, **kwargs)  # already traced: inline
        if self._runs_as_python:
            return self._run_python(args, kwargs)
        leaves, treedef = jax.tree_util.tree_flatten((args, kwargs), is_leaf=is_argument_leaf)
        given, read_ahead = (args, kwargs), []
        iterators = [id(x) for x in leaves if isinstance(x, DistributedIterator)]
        if iterators:
            # TF's `train_step(iterator)` with `next(iterator)` inside: the iterator's
            # next elements are read here and become inputs of the program.
            reads_key = ReadCounts.key(leaves, treedef)
            counts = self._reads.get(reads_key)
            if counts is ReadCounts.AS_PYTHON or len(set(iterators)) < len(iterators):
                return self._run_python(*given)  # (one iterator in two places: in order)
            try:
                args, kwargs = with_next_elements(given, read_ahead, counts)
            except StopIteration:
                # At the end the body decides, as TF's program does: `next` raises
                # OutOfRange, a `get_next_as_optional` loop returns.
                return self._run_python(*given)
            leaves, treedef = jax.tree_util.tree_flatten((args, kwargs), is_leaf=is_argument_leaf)
        kinds, dynamic, signature, statics = [], [], [], []
        for index, leaf in enumerate(leaves):
            kind, array = _classify(leaf)
            if kind == "uneven":
                # Replicas' inputs of different shapes: one program cannot take them.
                return self._run_python(*given, read_ahead)
            kinds.append(kind)
            if kind is None:
                if isinstance(leaf, collections.abc.Iterator):
                    # A Python iterator or generator: a program would keep what its
                    # trace read (and a trace's error would end a generator).
                    return self._run_python(*given, read_ahead)
                statics.append((index, static_key(leaf)))
                continue
            dynamic.append(array)
            signature.append((kind, array.shape, array.dtype, getattr(array, "weak_type", False)))
        key = (treedef, tuple(statics), tuple(signature))
        if self._globals is not None:
            key += (self._globals.part(),)
        program = self._programs.get(key)
        code = self._code
        if program is not None and (
            program.current() or self._still_the_program(program, treedef, leaves, kinds, dynamic)
        ):
            self._programs.move_to_end(key)
            self._retraces.hit(code)
            return self._locked(program, dynamic)
        if not relearned:  # (the trace that learned the reads counted already)
            self._retraces.traced(code, (None, key[1], key[2]))
        try:
            program = self._build(treedef, leaves, kinds, dynamic)
        except ReadsMore as more:
            # The trace took more (or fewer) elements than were read: read as many.
            put_back(read_ahead)
            self._reads.learn(reads_key, ReadCounts.AS_PYTHON if relearned else more.counts)
            return self._call(*given, relearned=True)
        except TooManyReads:
            # More steps than a program unrolls (or a loop to the end of the data):
            # calls with these Python arguments run as Python.
            self._reads.learn(reads_key, ReadCounts.AS_PYTHON)
            return self._run_python(*given, read_ahead)
        except _RUNS_AS_PYTHON:
            # The Python reads its input itself, or needs an input's value (TF's
            # `for _ in tf.range(steps)` ported as `range(steps)`): it runs as it
            # is, on every call, as AutoGraph's loop would run (each `run` compiled).
            self._runs_as_python = True
            return self._run_python(*given, read_ahead)
        except BaseException:
            put_back(read_ahead)  # (an error in the body: the elements are not lost)
            raise
        self._programs[key] = program
        return self._locked(program, dynamic)

    def _run_python(self, args, kwargs, read_ahead=()):
        """The Python function on the caller's arguments; elements read ahead for a
        program go back to their iterators first (the Python reads them itself)."""
        put_back(list(read_ahead))
        try:
            return self.python_function(*args, **kwargs)
        except StopIteration as error:
            if isinstance(error, EndOfInput):
                raise
            # What a program reading past the end raises in TF.
            raise EndOfInput(
                "End of sequence: the function read past the end of its input. "
                f"Received: {type(error).__name__} from {self.python_function!r}"
            ) from error

    def _locked(self, program, dynamic):
        with program.lock:
            return program(dynamic)

    def _build(self, treedef, leaves, kinds, dynamic):
        state = [v for v in (r() for r in self._state) if v is not None]
        # The strategies the function runs on, as the last trace found them: a plain
        # variable's value is placed beside their arrays (on their mesh).
        extendeds = self._extendeds
        for _ in range(_MAX_TRACES):
            trace = FunctionTrace(state)
            if any(_on_parameter_servers(v) for v in state):
                raise OnParameterServers()  # (runs as Python, as on the coordinator in TF)
            traced, values = self._trace(trace, state, extendeds, treedef, leaves, kinds, dynamic)
            again = _initialize_created(trace) or trace.created_variables
            if [id(e) for e in trace.extendeds] != [id(e) for e in extendeds]:
                extendeds, again = trace.extendeds, True  # (values placed for others)
            for extended in trace.extendeds:
                current = extended.variable_state()
                trace.need(current.mirrored + current.sync_on_read)
            if trace.needed:
                state = state + list(trace.needed.values())
                again = True
            if not again:
                break
        else:
            raise RuntimeError(
                "The function kept creating new variables on every trace. Create "
                "variables once, before the first call (build the model and the "
                f"optimizer first). Received: {self.python_function!r}"
            )
        self._state = [weakref.ref(v) for v in state]
        self._extendeds = extendeds
        self._tracing_count += 1
        layout = StateLayout([self._unchanged])
        lowered = layout.lower(traced, values, [for_trace(x) for x in dynamic])
        fingerprint = ProgramFingerprint(traced.jaxpr, self._out_record, self._unchanged)
        return FunctionProgram(
            lowered, state, trace.extendeds, self._out_record, layout, fingerprint
        )

    def _still_the_program(self, program, treedef, leaves, kinds, dynamic) -> bool:
        """Whether ``program``, out of date since its strategies' variables changed, is
        what the function traced with the program's own variables gives; then it is
        kept (``_program_reuse.py``): no compile for a model or metric created beside."""
        state = program.traced_state()
        if state is None:
            return False
        trace = FunctionTrace(state, only_state=True)
        try:
            traced, _ = self._trace(
                trace, state, program.extendeds, treedef, leaves, kinds, dynamic
            )
        except (ReadsMore, *_RUNS_AS_PYTHON):
            return False  # (the build that follows meets it again, and handles it)
        if _initialize_created(trace) or trace.created_variables or trace.needed:
            return False  # it created or read variables the program does not thread
        if [id(e) for e in trace.extendeds] != [id(e) for e in program.extendeds]:
            return False
        fingerprint = ProgramFingerprint(traced.jaxpr, self._out_record, self._unchanged)
        if fingerprint != program.fingerprint:
            return False
        program.keep()
        return True

    def _trace(self, trace, state, extendeds, treedef, leaves, kinds, dynamic):
        """``(traced, state values)``: the function traced with ``state`` threaded, its
        values placed for ``extendeds``. A trace that stops (``ReadsMore``, one that runs
        as Python) first gives the variables it created their values."""
        values = [_state_value(v, extendeds) for v in state]
        shardings = [getattr(x, "sharding", None) for x in values]
        traceable = self._traceable(trace, state, shardings, treedef, leaves, kinds)
        try:
            traced = jax.jit(traceable, donate_argnums=0).trace(
                values, [for_trace(x) for x in dynamic]
            )
        except (ReadsMore, *_RUNS_AS_PYTHON):
            _initialize_created(trace)  # the Python that runs (or traces) next uses them
            raise
        return traced, values

    def _traceable(self, trace, state, shardings, treedef, leaves, kinds):
        def program(state_values, dynamic_values):
            mapping = {id(v): x for v, x in zip(state, state_values)}
            dynamic_iter = iter(dynamic_values)
            rebuilt = []
            for leaf, kind in zip(leaves, kinds):
                if kind is None:
                    rebuilt.append(leaf)
                elif kind == "r":
                    rebuilt.append(PerReplica(None, _stacked=next(dynamic_iter), _validate=False))
                elif kind == "m":
                    value = next(dynamic_iter)  # one traced array for the argument's copies
                    copies = (value,) * len(leaf.values)
                    rebuilt.append(Mirrored(copies, _replicated=value, _validate=False))
                else:
                    rebuilt.append(next(dynamic_iter))
            args, kwargs = jax.tree_util.tree_unflatten(treedef, rebuilt)
            scope = FunctionScope(mapping, trace, state)
            trace.scope = scope
            trace.jax_trace = current_trace()
            with _context.function_trace(trace), scope:
                outputs = self.python_function(*args, **kwargs)
                check_reads((args, kwargs))  # (iterator arguments: as many read as taken)
                # In the scope: a returned variable gives its value as the function left it.
                arrays, self._out_record = flatten_outputs(outputs)
            self._unchanged = [scope.state_mapping[id(v)] is x for v, x in zip(state, state_values)]
            # New values keep their variables' shardings: no resharding next step.
            new_state = [
                keep_sharding(scope.state_mapping[id(v)], sharding)
                for v, sharding in zip(state, shardings)
            ]
            return new_state, arrays

        return program


def _initialize_created(trace) -> bool:
    """Gives variables created in ``trace`` (optimizer slots) their first values; any?

    They take them, and their distributed class, under the strategy.
    """
    if not pending_variables():
        return False
    strategies = [e.container_strategy for e in trace.extendeds]
    frame = _context.Frame(strategies[0], None) if strategies else None
    with _context.push(frame) if frame else contextlib.nullcontext():
        initialize_pending_variables()
    return True


def _classify(leaf):
    if isinstance(leaf, PerReplica):
        stacked = leaf.stacked
        if isinstance(stacked, jax.Array):
            return "r", stacked
        return "uneven", None  # components per device (or a host batch): run as Python
    if isinstance(leaf, DistributedValues):
        if leaf.replicated is not None:
            return "m", leaf.replicated
        return "uneven", None
    if isinstance(leaf, (jax.Array, np.ndarray, np.generic)):
        return "a", leaf
    return None, None


def function(func=None, *, input_signature=None, jit_compile=None, reduce_retracing=False, **kw):
    """Compiles a function around ``strategy.run`` into one program: ``tf.function``'s port.

    Works as ``@kd.function`` and ``@kd.function(...)``, on functions and
    methods. The function is traced once per input signature (array shapes and
    dtypes, distributed-value layout, Python values), every variable it uses is
    threaded through as state, and each ``strategy.run`` inside becomes part of
    the one program: a step is one dispatch.

    >>> import keras, keras_dist as kd
    >>> strategy = kd.MirroredStrategy(["/cpu:0", "/cpu:1"])
    >>> with strategy.scope():
    ...     total = keras.Variable(0.0, aggregation="sum")
    >>> @kd.function
    ... def step():
    ...     def replica_fn():
    ...         total.assign_add(kd.get_replica_context().replica_id_in_sync_group + 1.0)
    ...         return total.value
    ...     return strategy.reduce("MEAN", strategy.run(replica_fn), axis=None)
    >>> float(step()), float(step())
    (3.0, 6.0)
    >>> step.experimental_get_tracing_count()
    1
    """
    options = dict(
        input_signature=input_signature,
        jit_compile=jit_compile,
        reduce_retracing=reduce_retracing,
        **kw,
    )
    if func is None:
        return lambda f: Function(f, **options)
    return Function(func, **options)
