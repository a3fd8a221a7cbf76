"""The global distribution state: which strategy is current, and in which context.

One small object per thread holds a stack of frames. A frame says which
strategy is current and whether code runs in a replica context (inside
``strategy.run``) or in the cross-replica context (inside ``strategy.scope()``
or a ``merge_call``). Threads start in the default state; the eager engine
pushes a replica frame in each of its replica threads.

Keras keeps its own per-thread "current distribution", consulted when a
variable is created: every push and pop keeps it in step with the top frame,
so variables created under a strategy go through that strategy's policy.
"""

import contextlib
import dataclasses
import threading
from typing import Any

import keras

from keras_dist._thread_state import set_for_block


@dataclasses.dataclass(frozen=True)
class Frame:
    """One entry of the context stack."""

    strategy: Any
    replica_context: Any  # None in the cross-replica context
    entered_scope: bool = False  # pushed by ``strategy.scope()``
    engine: Any = None  # the compiled trace or eager run this frame belongs to


class _ThreadState(threading.local):
    def __init__(self):
        self.stack: list[Frame] = []
        self.function_trace = None  # the ``kd.function`` being traced, if any


_state = _ThreadState()


# The frame in effect outside any scope. The default strategy registers it
# when it is defined (``set_default_strategy``): this module sits below the
# strategies. Asked for several times per step, so built once.
_default_frame = None


def set_default_strategy(strategy, replica_context) -> None:
    """Registers the strategy in effect outside any scope and its replica context."""
    global _default_frame
    _default_frame = Frame(strategy, replica_context)


def default_replica_context_of(strategy):
    """The default strategy's replica context for it; ``None`` for every other strategy."""
    return _default_frame.replica_context if strategy is _default_frame.strategy else None


def current_frame() -> Frame:
    """The innermost frame of this thread (the default one when empty)."""
    stack = _state.stack
    return stack[-1] if stack else _default_frame


def other_strategy_in_scope(strategy):
    """An enclosing frame's strategy other than ``strategy``, or ``None``.

    Strategies do not nest: entering one's scope or ``run`` inside another's is
    an error (TF's "Mixing different tf.distribute.Strategy objects").
    """
    for frame in _state.stack:
        if frame.strategy is not strategy:
            return frame.strategy
    return None


@contextlib.contextmanager
def push(frame: Frame):
    """Makes ``frame`` current for the body; restores the previous state after."""
    previous_distribution = keras.distribution.distribution()
    _state.stack.append(frame)
    keras.distribution.set_distribution(frame.strategy.extended.keras_distribution)
    try:
        yield frame
    finally:
        _state.stack.pop()
        keras.distribution.set_distribution(previous_distribution)


def outside_any_strategy():
    """The body runs as outside every scope: the default strategy, plain Keras variables."""
    return push(_default_frame)


def keras_distribution():
    """Keras's current distribution, put back first where Keras's state was cleared in a scope.

    ``keras.backend.clear_session()`` replaces Keras's per-thread state, the current
    distribution with it, while our frames (and so the scope the user is in) stay: the
    scope's distribution is set again the first time anything asks for it, so the
    next model's variables are the strategy's again (TF's ``clear_session`` drops the
    scope instead).
    """
    distribution = keras.distribution.distribution()
    stack = _state.stack
    if distribution is None and stack:
        distribution = stack[-1].strategy.extended.keras_distribution
        if distribution is not None:
            keras.distribution.set_distribution(distribution)
    return distribution


def strategy_in_effect():
    """The current non-default strategy, unless a Keras distribution scope entered inside
    its scope (``keras.distribution.DataParallel(...).scope()``) replaces it; else ``None``.
    """
    stack = _state.stack
    if not stack or not has_strategy():
        return None
    if keras_distribution() is not stack[-1].strategy.extended.keras_distribution:
        return None
    return stack[-1].strategy


def current_function_trace():
    """The ``kd.function`` trace this thread is in (``strategy.run`` joins it), or ``None``."""
    return _state.function_trace


def function_trace(trace):
    """Marks the body as the trace of a ``kd.function``; restores the previous one after."""
    return set_for_block(_state, "function_trace", trace)


class InputReadInTrace(BaseException):
    """A ``kd.function``'s trace read a distributed dataset or iterator itself.

    What a trace reads would be a constant of the program: every later call
    would train on the same batches. The function stops tracing and runs its
    Python on each call instead (each ``strategy.run`` in it still compiled),
    as ``tf.function`` reads its input afresh on each call. A ``BaseException``:
    the traced code's own ``except Exception`` must not swallow it.
    """


def refuse_input_read_in_trace() -> None:
    """Raises ``InputReadInTrace`` when a ``kd.function`` is being traced."""
    if _state.function_trace is not None:
        raise InputReadInTrace()


def get_strategy():
    """Returns the current strategy: the one whose scope or ``run`` we are in.

    Outside any scope this is the default strategy, which places everything on
    the default device and runs ``run`` functions directly.

    >>> import keras_dist as kd
    >>> kd.get_strategy() is kd.get_strategy()
    True
    """
    return current_frame().strategy


def has_strategy() -> bool:
    """Whether a non-default strategy is current.

    >>> import keras_dist as kd
    >>> kd.has_strategy()
    False
    """
    return get_strategy() is not _default_frame.strategy


def get_replica_context():
    """Returns the current ``ReplicaContext``, or ``None`` in cross-replica context.

    Outside any scope this is the default replica context (never ``None``);
    inside ``strategy.scope()`` it is ``None``; inside ``strategy.run`` it is
    that replica's context.

    >>> import keras_dist as kd
    >>> kd.get_replica_context().num_replicas_in_sync
    1
    """
    return current_frame().replica_context


def get_cross_replica_context():
    """Returns the current strategy in cross-replica context, else ``None``.

    >>> import keras_dist as kd
    >>> strategy = kd.MirroredStrategy(["/cpu:0", "/cpu:1"])
    >>> with strategy.scope():
    ...     kd.get_cross_replica_context() is strategy
    True
    >>> inside = strategy.run(lambda: kd.get_cross_replica_context() is None)
    >>> [bool(v) for v in strategy.experimental_local_results(inside)]
    [True, True]
    """
    frame = current_frame()
    return frame.strategy if frame.replica_context is None else None


def in_cross_replica_context() -> bool:
    """Whether we are in a strategy's scope and not inside one of its replicas.

    >>> import keras_dist as kd
    >>> kd.in_cross_replica_context()
    False
    """
    return current_frame().replica_context is None


def experimental_set_strategy(strategy) -> None:
    """Makes ``strategy`` current without a ``with`` block; ``None`` resets it.

    Works like entering ``strategy.scope()`` for the rest of the program. It
    may not be called inside a scope.

    >>> import keras_dist as kd
    >>> s = kd.OneDeviceStrategy("/cpu:0")
    >>> kd.experimental_set_strategy(s)
    >>> kd.get_strategy() is s
    True
    >>> kd.experimental_set_strategy(None)
    """
    global _set_strategy_scope
    stack = _state.stack
    outer = stack[:-1] if _set_strategy_scope is not None else stack
    if outer:
        raise RuntimeError(
            "Must not be called inside a `tf.distribute.Strategy` scope. Leave the "
            f"`with strategy.scope():` block first. Received: strategy={strategy!r}"
        )
    if _set_strategy_scope is not None:
        scope, _set_strategy_scope = _set_strategy_scope, None
        scope.__exit__(None, None, None)
    if strategy is not None:
        scope = strategy.scope()
        scope.__enter__()
        _set_strategy_scope = scope


_set_strategy_scope = None


def running_replica_context():
    """The ``ReplicaContext`` of a strategy's ``run`` we are inside, else ``None``.

    ``None`` in the cross-replica context and in the default replica context
    (outside any strategy), where replica-only rules do not apply.

    >>> running_replica_context() is None
    True
    """
    replica_context = current_frame().replica_context
    if replica_context is None or replica_context.is_default:
        return None
    return replica_context
