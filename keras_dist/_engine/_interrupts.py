"""Ctrl-C during a compiled step is raised once the step's new values are stored.

A step donates the variables' arrays to its program: from its dispatch until
the new values are stored, the variables hold deleted arrays. A
``KeyboardInterrupt`` raised there (Ctrl-C, a notebook's "interrupt") left
every variable of the model and optimizer deleted ("Array has been deleted"),
and reading one later could crash XLA. So SIGINT is held for that stretch and
raised right after it: the variables keep the finished step's values, as
``tf.function``'s do, and the next cell can go on training.
"""

# ``signal``'s own C functions: ``signal.signal`` and ``signal.getsignal`` turn every
# handler into an enum member first (a failed lookup for a function), which cost a
# step about 10 µs, a fifth of a small step's host time.
import _signal
import threading

_SIGINT = int(_signal.SIGINT)


class interrupts_held:  # noqa: N801 - used as the function it was: ``with interrupts_held():``
    """Within, SIGINT's handler runs at the end of the block instead of at once.

    Only on the main thread (where Python runs signal handlers) and where SIGINT
    has a Python handler (``KeyboardInterrupt``'s by default).

    >>> with interrupts_held():
    ...     pass
    """

    __slots__ = ("_previous", "_received")

    def __enter__(self):
        self._previous = None
        if threading.current_thread() is not threading.main_thread():
            return
        previous = _signal.getsignal(_SIGINT)
        if not callable(previous):  # ignored, or the OS default: nothing to hold
            return
        self._previous, self._received = previous, []
        _signal.signal(_SIGINT, self._receive)

    def _receive(self, signum, frame):
        self._received.append(frame)

    def __exit__(self, *exc_info):
        previous = self._previous
        if previous is None:
            return
        _signal.signal(_SIGINT, previous)
        if self._received:
            previous(_SIGINT, self._received[0])
