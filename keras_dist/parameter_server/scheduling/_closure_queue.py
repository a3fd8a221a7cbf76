"""The queue of scheduled functions between ``schedule`` and the workers' threads.

As TF's ``CoordinatedClosureQueue``: ``schedule`` puts, each worker's thread
gets, and a closure whose worker was lost is put back at the front, to run on
another worker (a ps task applies each call's writes once: ``run_id``). The
first error of a closure is kept until ``join`` (or the next ``schedule``)
raises it; the closures still queued are cancelled: their ``RemoteValue``
raises ``CancelledError``, and they never run. Closures already running on
other workers cannot be stopped there (TF cancels their ops): they finish, and
their ``RemoteValue`` gives what they returned, since their writes are applied.
So ``CancelledError`` always means the function did not run, and rescheduling
it, as the error says, applies its step once.
"""

import collections
import threading
import traceback

from keras_dist import errors
from keras_dist.parameter_server.scheduling._remote_value import raisable


def _cancelled(error: BaseException) -> errors.CancelledError:
    cancelled = errors.CancelledError(
        "The corresponding function is cancelled. Please reschedule the function. "
        f"Received: an earlier function's {type(error).__name__}: {error}"
    )
    cancelled.__cause__ = error  # what stopped the functions (``fit`` raises that)
    return cancelled


def _without_locals(error: BaseException) -> None:
    """Drops the local variables of ``error``'s traceback (its lines stay).

    The error may be kept long (until ``join``, or for good when nobody asks):
    its frames would keep the failed calls, their variables and a dropped model.
    """
    traceback.clear_frames(error.__traceback__)


class Closure:
    """One scheduled call and the ``RemoteValue`` that receives its result."""

    def __init__(self, call, remote_value):
        self.call = call
        self.remote_value = remote_value


class ClosureQueue:
    """Closures waiting for a worker, and how many are running."""

    def __init__(self):
        self._queue: collections.deque = collections.deque()
        self._running: set = set()  # the closures in flight
        # Closures in flight when an error came -> the CancelledError they get
        # should they come back unrun (``put_back``). They run on and give their
        # results; a failure of theirs goes to their RemoteValue only (not
        # raised again by ``join``: the first error stands for them all).
        self._after_error: dict = {}
        self._error = None
        self._condition = threading.Condition()
        self.stopped = False

    def put(self, closure: Closure) -> None:
        with self._condition:
            self._raise_error_locked()
            self._queue.append(closure)
            self._condition.notify_all()

    def get(self, timeout: float) -> "Closure | None":
        """The next closure (now in flight), or ``None`` after ``timeout`` seconds."""
        closures = self.get_many(timeout, limit=1, workers=1)
        return closures[0] if closures else None

    def get_many(self, timeout: float, limit: int, workers: int) -> list:
        """The next closures (now in flight), ``[]`` after ``timeout`` seconds.

        The first, and after it up to ``limit`` in all that run the same
        program, but no more than a fair share of the queue between ``workers``.
        """
        with self._condition:
            if not self._condition.wait_for(lambda: self._queue or self.stopped, timeout):
                return []
            if self.stopped:
                return []
            share = min(limit, -(-len(self._queue) // workers))
            taken = [self._queue.popleft()]
            program = getattr(taken[0].call, "program", None)
            while (
                self._queue
                and len(taken) < share
                and getattr(self._queue[0].call, "program", None) is program
            ):
                taken.append(self._queue.popleft())
            self._running.update(taken)
            return taken

    def put_back(self, closure: Closure) -> None:
        """Returns a closure that did not run (its worker was lost, or an earlier call
        of its request failed) to the front of the queue; after an error, cancels it."""
        with self._condition:
            cancelled = self._done_with(closure)
            if cancelled is None and self._error is not None:
                cancelled = _cancelled(self._error)
            if cancelled is not None:
                closure.remote_value.set_error(cancelled)
            else:
                self._queue.appendleft(closure)
            self._condition.notify_all()

    def _done_with(self, closure) -> "errors.CancelledError | None":
        """Counts ``closure`` out of flight; if it was in flight when an error came, the
        cancellation that error gave it (dropped here: the error holds a step's frames)."""
        self._running.discard(closure)
        return self._after_error.pop(closure, None)

    def mark_finished(self, closure, value) -> None:
        """A closure returned ``value``: its ``RemoteValue`` gets it (it ran, even if
        another closure failed meanwhile)."""
        with self._condition:
            self._done_with(closure)
            closure.remote_value.set_value(value)
            # Only ``wait`` waits for a closure to finish (getters wait for the
            # queue): wake it when the last one is done, not after every one.
            if not self._queue and not self._running:
                self._condition.notify_all()

    def mark_failed(self, closure, error: BaseException) -> None:
        """A closure failed: keep its error and cancel what is queued.

        A closure that was in flight when an earlier one failed keeps its own
        error in its ``RemoteValue``; ``join`` raises the first error only.
        """
        _without_locals(error)
        with self._condition:
            after_error = self._done_with(closure) is not None
            closure.remote_value.set_error(error)
            if not after_error:
                self._set_error_locked(error)
            self._condition.notify_all()

    def set_error(self, error: BaseException) -> None:
        """An error outside any closure (a lost ps task)."""
        _without_locals(error)
        with self._condition:
            self._set_error_locked(error)
            self._condition.notify_all()

    def _set_error_locked(self, error):
        if self._error is None:
            self._error = error
            for closure in self._running:
                self._after_error.setdefault(closure, _cancelled(error))
        while self._queue:
            self._queue.popleft().remote_value.set_error(_cancelled(self._error))

    def _raise_error_locked(self):
        if self._error is not None:
            error, self._error = self._error, None
            raise raisable(error)

    def wait(self, timeout: "float | None" = None) -> None:
        """Blocks until nothing is queued or running; raises (then clears) the first error."""
        with self._condition:
            # After an error the queue is cancelled; the closures still running
            # are waited for, so their errors are cleared with the first one.
            finished = self._condition.wait_for(
                lambda: not self._queue and not self._running, timeout
            )
            self._raise_error_locked()
            if not finished:
                raise errors.DeadlineExceededError(
                    f"The scheduled functions did not finish within {timeout} s: "
                    f"{len(self._queue)} queued, {len(self._running)} running. "
                    f"Received: timeout={timeout}"
                )

    def done(self) -> bool:
        with self._condition:
            self._raise_error_locked()
            return not self._queue and not self._running

    def stop(self) -> None:
        with self._condition:
            self.stopped = True
            self._condition.notify_all()
