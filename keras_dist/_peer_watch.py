"""Every multi-process execution ends within a deadline, or the lost peers are named.

JAX alone would either raise gloo's bare "Connection closed by peer" (a peer
died) or block forever (a peer is stuck outside the collective). Instead
``PeerWatch`` dispatches each execution on its own thread and waits for it
with ``CommunicationOptions.timeout_seconds``; on a transport error or a missed
deadline the survivors find out *which* tasks are missing by asking every peer
directly (``_presence``; the coordination service's key-value store where that
is not started), tell the others, and raise ``UnavailableError`` or
``DeadlineExceededError`` naming them.

``fit``'s steps may still run when their dispatch returns (``_engine/_gate.py``,
``deferring``): the caller's next wait, with the same deadline, raises the
error. Should the caller block outside such a wait instead (say, reading a
running step's loss directly), a watchdog names the lost tasks on stderr and
ends the process once the deadline is well past: never a silent hang.

After such a failure the process cannot take part in collectives again, and
JAX's own shutdown would wait on the lost peer or abort from its error-polling
thread; an exit hook ends the process with status 1 instead (the traceback is
already printed by then).
"""

import atexit
import contextlib
import queue
import sys
import threading
import time

import jax
from jax._src import distributed

from keras_dist._process_exit import leave_now
from keras_dist.errors import DeadlineExceededError
from keras_dist.errors import UnavailableError

_KEY_PREFIX = "keras_dist/waiting_at_failure/"
# How long survivors wait for each other to report in after a failure.
_DIAGNOSIS_SECONDS = 3.0
# How often a waiting caller looks for a survivor's news of a lost task.
_NEWS_POLL_SECONDS = 0.05
# How long past its deadline an execution nobody waits for may run before the
# watchdog ends the process (a waiting caller raises first: it diagnoses in 3 s).
_WATCHDOG_GRACE_SECONDS = 15.0


class PeerWatch:
    """Waits for multi-process executions, turning lost peers into named errors.

    Args:
        task_names: the name of each process id, e.g. ``["chief 0", "worker 0"]``.
        process_id: this process's id.
        timeout_seconds: how long one execution may take, dispatch included.

    >>> watch = PeerWatch(["worker 0"], 0, timeout_seconds=30)
    >>> out, pending = watch.dispatch(lambda x: x + 1, 1, run_on=True)
    >>> pending.block_until_ready(); out
    2
    """

    def __init__(self, task_names, process_id, timeout_seconds, presence=None):
        self._task_names = list(task_names)
        self._process_id = process_id
        self._timeout = timeout_seconds
        self._presence = presence  # the peers asked directly (``_presence``), when known
        self._requests: queue.SimpleQueue = queue.SimpleQueue()
        self._started = False
        self._running = None  # the Pending whose execution the watch's thread waits for
        self._failure = None

    @contextlib.contextmanager
    def translating_failures(self):
        """Turns a collective's failure raised inside the block into a named error."""
        if self._failure is not None:
            raise self._failure
        try:
            yield
        except Exception as error:
            if not _is_collective_failure(error):
                raise
            self._fail(error, timed_out=False)

    def dispatch(self, fn, *args, run_on: bool = False):
        """``fn(*args)`` dispatched: its outputs, and a ``Pending`` that waits for them.

        On CPU a multi-process execution may block in its dispatch, so the
        dispatch itself runs on the watch's thread while the caller waits with
        the deadline. With ``run_on`` this returns once the execution is
        dispatched: the watch waits for it to end while the caller goes on with
        host work (``fit``'s next batch) and waits with ``Pending.block_until_ready``.
        Otherwise it returns once the execution has ended (one wake-up, not two).
        (``fn`` must not depend on the caller's thread-local state: it is an
        already built program.)
        """
        if self._failure is not None:
            raise self._failure
        pending = Pending(self._wait_for, time.monotonic() + self._timeout)

        def job():
            try:
                pending.out = fn(*args)
                if run_on:
                    pending.dispatched.set()
                self._running = pending
                _block_on_one_output(pending.out)
            except Exception as error:  # handed to the waiting caller
                pending.error = error
            self._running = None
            pending.dispatched.set()
            pending.done.set()

        self._start_threads()
        self._requests.put(job)
        self._wait_for(pending, pending.dispatched)
        return pending.out, pending

    def _wait_for(self, pending, event):
        news = self._presence.news if self._presence is not None else None
        while not event.is_set():
            left = pending.deadline - time.monotonic()
            if left <= 0:
                self._fail(None, timed_out=True)
            # A survivor's news of a lost task ends the wait at once: this
            # execution may wait on a survivor that left it, and never end.
            if news is not None and news.is_set():
                self._fail(None, timed_out=self._presence.news_timed_out())
            event.wait(min(left, _NEWS_POLL_SECONDS) if news is not None else left)
        if pending.error is not None:
            with self.translating_failures():
                raise pending.error

    def _start_threads(self):
        # They may stay blocked for good if a peer never answers: daemons.
        if not self._started:
            self._started = True
            for target, name in ((self._serve, "watch"), (self._watchdog, "watchdog")):
                threading.Thread(target=target, name=f"keras_dist-peer-{name}", daemon=True).start()

    def _serve(self):
        while True:
            self._requests.get()()

    def _watchdog(self):
        while True:
            time.sleep(1.0)
            running = self._running
            if (
                running is None
                or self._failure is not None
                or time.monotonic() < running.deadline + _WATCHDOG_GRACE_SECONDS
            ):
                continue
            error = self._named_error(None, timed_out=True)
            if self._failure is None:  # (no caller raised meanwhile)
                print(
                    f"keras_dist: {type(error).__name__}: {error} This process was blocked "
                    "outside keras_dist's wait for the execution (reading a running step's "
                    "results directly); it ends now.",
                    file=sys.stderr,
                )
                leave_now(1)

    def _fail(self, cause, timed_out):
        if self._failure is not None:  # (the watchdog or another wait named it already)
            raise self._failure
        error = self._named_error(cause, timed_out)
        self._failure = error
        _exit_after_failure()
        raise error from cause

    def _named_error(self, cause, timed_out):
        lost = self._missing_peers(timed_out)
        names = ", ".join(lost) if lost else "an unknown task"
        if timed_out:
            return DeadlineExceededError(
                f"A collective did not complete within {self._timeout} s: {names} did not "
                "reach it (stuck or dead). The other tasks were waiting for it. Check "
                "that task's log; raise CommunicationOptions(timeout_seconds=...) if a "
                "step legitimately takes longer.",
                lost,
            )
        return UnavailableError(
            f"Lost contact with {names} during a collective: the task died or closed "
            f"its connection. Check that task's log. (JAX reported: {cause})",
            lost,
        )

    def _missing_peers(self, timed_out: bool) -> list:
        """The lost tasks' names; the survivors found alive are told which."""
        if self._presence is None:
            return [self._task_names[i] for i in self._missing_in_service()]
        presence = self._presence
        presence.failed = True
        others = [i for i in range(len(self._task_names)) if i != self._process_id]
        answers = presence.survey(others)
        if presence.news.is_set():
            # A survivor found them first. One that sent news and left since is
            # not lost: the tasks it named are, and any other that is silent.
            silent = {i for i, failed in answers.items() if failed is None}
            lost = (silent - set(presence.news_senders())) | set(presence.lost_news())
        elif timed_out:
            # Healthy peers reach the same deadline and find the collective broken
            # too; a task that stays silent, or alive but never gets there, is stuck.
            deadline = time.monotonic() + _DIAGNOSIS_SECONDS
            while not all(answers.values()) and time.monotonic() < deadline:
                time.sleep(0.2)
                answers.update(presence.survey([i for i, f in answers.items() if not f]))
            lost = {i for i, failed in answers.items() if not failed}
        else:
            lost = {i for i, failed in answers.items() if failed is None}
        lost.discard(self._process_id)
        alive = [i for i, failed in answers.items() if failed is not None and i not in lost]
        presence.tell_lost(alive, lost, timed_out)
        return [self._task_names[i] for i in sorted(lost)]

    def _missing_in_service(self) -> list:
        """The tasks that did not report in, through the coordination service."""
        client = distributed.global_state.client
        others = [i for i in range(len(self._task_names)) if i != self._process_id]
        try:
            client.key_value_set(f"{_KEY_PREFIX}{self._process_id}", "1")
            deadline = time.monotonic() + _DIAGNOSIS_SECONDS
            while True:
                reported = {
                    int(key.rsplit("/", 1)[-1]) for key, _ in client.key_value_dir_get(_KEY_PREFIX)
                }
                missing = [i for i in others if i not in reported]
                if not missing or time.monotonic() > deadline:
                    break
                time.sleep(0.1)
        except Exception:
            # The coordination service runs in process 0: if it cannot be
            # reached, process 0 is the one that is gone.
            missing = [0] if self._process_id != 0 else others
        return missing


class Pending:
    """One execution ``PeerWatch.dispatch`` handed to its thread, due by ``deadline``."""

    def __init__(self, wait_for, deadline):
        self._wait_for = wait_for
        self.deadline = deadline  # time.monotonic()'s clock
        self.dispatched = threading.Event()
        self.done = threading.Event()
        self.out = None
        self.error = None

    def block_until_ready(self):
        """Waits for the execution to end; a lost peer raises a named error."""
        self._wait_for(self, self.done)


def _block_on_one_output(out):
    """Waits for a program: its outputs on this process's devices are ready together."""
    for leaf in jax.tree_util.tree_leaves(out):
        if isinstance(leaf, jax.Array):
            if not leaf.is_deleted():
                leaf.block_until_ready()
            return


def _is_collective_failure(error) -> bool:
    """Whether JAX's error comes from a collective's transport (not the user's program)."""
    message = str(error)
    return any(
        marker in message
        for marker in (
            "Gloo",
            "gloo",
            "NCCL",
            "Connection closed",
            "Connection reset",
            "rendezvous",
        )
    )


_exit_hook_installed = False


def _exit_after_failure():
    """Ends the process with status 1 at exit, skipping JAX's shutdown of a broken cluster."""
    global _exit_hook_installed
    if _exit_hook_installed:
        return
    _exit_hook_installed = True

    # atexit runs the last registered first: this runs before JAX's hooks.
    atexit.register(leave_now, 1)
