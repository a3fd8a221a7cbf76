"""Ctrl-C during a compiled step is raised once the step's new values are stored.

A step donates the variables' arrays to its program: from its dispatch until
the new values are stored, the variables hold deleted arrays. A
``KeyboardInterrupt`` raised there (Ctrl-C, a notebook's "interrupt") left
every variable of the model and optimizer deleted ("Array has been deleted"),
and reading one later could crash XLA. So SIGINT is held for that stretch and
raised right after it: the variables keep the finished step's values, as
``tf.function``'s do, and the next cell can go on training.
"""

import contextlib
import signal
import threading


@contextlib.contextmanager
def interrupts_held():
    """Within, SIGINT's handler runs at the end of the block instead of at once.

    Only on the main thread (where Python runs signal handlers) and where SIGINT
    has a Python handler (``KeyboardInterrupt``'s by default).

    >>> with interrupts_held():
    ...     pass
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.getsignal(signal.SIGINT)
    if not callable(previous):  # ignored, or the OS default: nothing to hold
        yield
        return
    received = []
    signal.signal(signal.SIGINT, lambda signum, frame: received.append(frame))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
        if received:
            previous(signal.SIGINT, received[0])
