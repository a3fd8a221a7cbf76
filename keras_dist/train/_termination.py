"""How a ``PreemptionCheckpointHandler`` learns that its process will be stopped.

* ``TerminationConfig`` says what counts as a notice (``termination_watcher_fn``,
  else ``SIGTERM``), how to exit after saving, how long the grace period is,
  and how to save.
* A ``Notice`` is set when the notice arrives: from a ``SIGTERM`` handler
  (``SignalWatch``) or from a thread that polls the user's function
  (``PollingWatch``). Neither holds the handler, so a dropped handler's
  watch is closed by its finalizer: the thread ends and ``SIGTERM`` goes
  back to the handler it had before.

With several processes JAX's preemption notifier takes ``SIGTERM`` and its
sync manager picks the step every process saves at (see
``callbacks/_preemption.py``, which does the same for ``fit``); a polled
notice is turned into a ``SIGTERM`` to this process so that the notifier hears
it.
"""

import os
import signal
import sys
import threading
import time

from keras_dist import _distributed_runtime

RESTART_EXIT_CODE = 42  # TF's exit code off Google's platforms
POLL_INTERVAL_SECONDS = 1.0  # how often TF calls ``termination_watcher_fn``


class TerminationConfig:
    """How a ``PreemptionCheckpointHandler`` detects termination, saves and exits.

    ``tf.distribute.experimental.TerminationConfig``'s counterpart. Defaults
    (TF's off Google Cloud): ``SIGTERM`` is the notice
    (``termination_watcher_fn=None``; otherwise a fast, non-blocking function
    polled every second that returns ``True`` once termination is coming);
    ``exit_fn`` is ``sys.exit(42)``; ``grace_period=0`` saves and exits at the
    next step boundary (a longer one saves at once, trains on, and saves again
    shortly before the period ends); ``save_fn=None`` saves with the handler's
    ``CheckpointManager``.

    >>> import keras_dist as kd
    >>> config = kd.experimental.TerminationConfig(exit_fn=lambda: None, grace_period=0)
    >>> config.grace_period
    0
    """

    def __init__(self, termination_watcher_fn=None, exit_fn=None, grace_period=None, save_fn=None):
        self.termination_watcher_fn = termination_watcher_fn
        self.exit_fn = exit_fn
        self.grace_period = grace_period
        self.save_fn = save_fn


def default_exit() -> None:
    """Exits with the code a platform restarts on (TF's default, 42)."""
    sys.exit(RESTART_EXIT_CODE)


class Notice:
    """Set once termination was announced; remembers when."""

    def __init__(self):
        self._event = threading.Event()
        self.received_at = None

    def set(self) -> None:
        """Records the notice (first time only)."""
        if not self._event.is_set():
            self.received_at = time.time()
            self._event.set()

    def is_set(self) -> bool:
        """Whether the notice arrived."""
        return self._event.is_set()

    def clear(self) -> None:
        """Forgets the notice (after an ``exit_fn`` that returned)."""
        self.received_at = None
        self._event.clear()


class SignalWatch:
    """Sets ``notice`` on ``SIGTERM`` (main thread only); ``close`` restores the old handler.

    A second ``SIGTERM`` before a step boundary acted on the first (a stuck
    step) goes to the previous handler at once: SIGTERM is never swallowed.
    """

    def __init__(self, notice: Notice):
        if threading.current_thread() is not threading.main_thread():
            raise RuntimeError(
                "A `PreemptionCheckpointHandler` that watches SIGTERM must be created in "
                "the main thread: Python delivers signals only there. Pass a "
                "`TerminationConfig(termination_watcher_fn=...)` to watch otherwise. "
                f"Received: thread {threading.current_thread().name!r}"
            )
        previous = signal.getsignal(signal.SIGTERM)
        self._previous = previous if previous is not None else signal.SIG_DFL

        def on_sigterm(signum, frame):
            if notice.is_set():
                signal.signal(signal.SIGTERM, self._previous)
                signal.raise_signal(signum)
                return
            notice.set()

        self._handler = on_sigterm
        signal.signal(signal.SIGTERM, on_sigterm)

    def close(self) -> None:
        """Gives ``SIGTERM`` back to the handler it had before (if it is still ours)."""
        handler, self._handler = self._handler, None
        if handler is None or signal.getsignal(signal.SIGTERM) is not handler:
            return
        try:
            signal.signal(signal.SIGTERM, self._previous)
        except ValueError:
            pass  # a finalizer outside the main thread cannot; the process is ending


class PollingWatch:
    """Calls ``watcher_fn`` every ``interval`` seconds on a thread; ``on_notice()`` once it
    returns ``True``. ``close`` ends the thread."""

    def __init__(self, watcher_fn, on_notice, interval: "float | None" = None):
        interval = POLL_INTERVAL_SECONDS if interval is None else interval
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=_poll,
            args=(watcher_fn, on_notice, self._stop, interval),
            name="keras_dist-termination-watcher",
            daemon=True,
        )
        self._thread.start()

    def close(self) -> None:
        """Stops polling and waits for the thread (unless called from it)."""
        self._stop.set()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=10 * POLL_INTERVAL_SECONDS)


def _poll(watcher_fn, on_notice, stop: threading.Event, interval: float) -> None:
    while not stop.is_set():
        if watcher_fn():
            on_notice()
            return
        stop.wait(interval)


class NotifierWatch:
    """Several processes: ``SIGTERM`` goes to JAX's preemption notifier until ``close``."""

    def __init__(self, watcher_fn=None):
        self._give_back = _distributed_runtime.hand_sigterm_to_preemption_notifier()
        self._polling = None
        if watcher_fn is not None:
            self._polling = PollingWatch(watcher_fn, _sigterm_to_self)

    def close(self) -> None:
        """Stops polling and gives ``SIGTERM`` back."""
        if self._polling is not None:
            self._polling.close()
            self._polling = None
        give_back, self._give_back = self._give_back, None
        if give_back is not None:
            give_back()


def _sigterm_to_self() -> None:
    # JAX's notifier hears only SIGTERM: a polled notice is passed on as one.
    os.kill(os.getpid(), signal.SIGTERM)
