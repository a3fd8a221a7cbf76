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

from keras.src.backend.common import global_state

_KERAS_DISTRIBUTION = "distribution"


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


_state = _ThreadState()


_DEFAULT_FRAME = None


def _default_frame() -> Frame:
    # Asked for several times per step (every context check outside a scope):
    # built once, since the default strategy and its replica context never change.
    global _DEFAULT_FRAME
    if _DEFAULT_FRAME is None:
        from keras_dist.strategies._default import default_strategy

        strategy = default_strategy()
        _DEFAULT_FRAME = Frame(strategy, strategy.extended._default_replica_context)
    return _DEFAULT_FRAME


def current_frame() -> Frame:
    """The innermost frame of this thread (the default one when empty)."""
    stack = _state.stack
    return stack[-1] if stack else _default_frame()


def frames() -> list:
    """This thread's frames, outermost first (empty in the default state)."""
    return list(_state.stack)


@contextlib.contextmanager
def push(frame: Frame):
    """Makes ``frame`` current for the body; restores the previous state after."""
    previous_distribution = global_state.get_global_attribute(_KERAS_DISTRIBUTION)
    _state.stack.append(frame)
    global_state.set_global_attribute(
        _KERAS_DISTRIBUTION, frame.strategy.extended._keras_distribution
    )
    try:
        yield frame
    finally:
        _state.stack.pop()
        global_state.set_global_attribute(_KERAS_DISTRIBUTION, previous_distribution)


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
    from keras_dist.strategies._default import is_default_strategy

    return not is_default_strategy(get_strategy())


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
    """Returns the current strategy in cross-replica context, else ``None``."""
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
