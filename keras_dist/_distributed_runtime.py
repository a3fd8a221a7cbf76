"""JAX's multi-process runtime, as ``MultiWorkerMirroredStrategy`` uses it.

* ``initialize`` starts ``jax.distributed`` once per process (gloo
  collectives on CPU) and refuses, with a message saying why, when JAX has
  already started on its own.
* ``PeerWatch`` waits for every multi-process execution with a deadline. JAX
  alone would either raise gloo's bare "Connection closed by peer" (a peer
  died) or block forever (a peer is stuck outside the collective). Instead the
  survivors find out *which* tasks are missing, through the coordination
  service's key-value store, and raise ``UnavailableError`` or
  ``DeadlineExceededError`` naming them.

After such a failure the process cannot take part in collectives again, and
JAX's own shutdown would wait on the lost peer or abort from its error-polling
thread; an exit hook ends the process with status 1 instead (the traceback is
already printed by then).
"""

import atexit
import contextlib
import os
import queue
import sys
import threading
import time

import jax

# JAX's own multi-process state: whether it started, and its coordination client.
from jax._src import distributed
from jax._src import xla_bridge

from keras_dist.errors import DeadlineExceededError
from keras_dist.errors import UnavailableError

_KEY_PREFIX = "keras_dist/waiting_at_failure/"
# How long survivors wait for each other to report in after a failure.
_DIAGNOSIS_SECONDS = 3.0


def is_initialized() -> bool:
    """Whether ``jax.distributed`` has been started in this process."""
    return distributed.global_state.client is not None


def initialize(coordinator_address, num_processes, process_id, *, timeout_seconds, collectives):
    """Starts ``jax.distributed`` for this process, or checks the running one matches."""
    state = distributed.global_state
    if state.client is not None:
        if (state.num_processes, state.process_id) != (num_processes, process_id):
            raise RuntimeError(
                "jax.distributed is already initialized for another cluster layout: "
                f"{state.num_processes} processes with this one as process "
                f"{state.process_id}, but the cluster resolver describes {num_processes} "
                f"processes with this one as process {process_id}. Received: "
                f"coordinator_address={coordinator_address!r}"
            )
        return
    if xla_bridge.backends_are_initialized():
        raise RuntimeError(
            "MultiWorkerMirroredStrategy must be created before JAX starts: JAX's "
            "multi-process runtime can only be initialized before the first JAX "
            "computation or device query (jax.devices(), creating a Keras model...). "
            "Create the strategy at the top of the program. Received: this process "
            f"(task {process_id} of {num_processes}) already used JAX."
        )
    if collectives is not None:
        jax.config.update("jax_cpu_collectives_implementation", collectives)
    jax.distributed.initialize(
        coordinator_address=coordinator_address,
        num_processes=num_processes,
        process_id=process_id,
        initialization_timeout=int(timeout_seconds),
        # A dead peer makes JAX end every process after this long; the watch
        # below reports it sooner and by name.
        heartbeat_timeout_seconds=max(int(timeout_seconds), 10),
    )
    _leave_on_uncaught_exception()


def leave_now(code):
    """Ends this process at once, without JAX's shutdown.

    JAX's shutdown waits at a barrier for every process. A process ending with
    an error must not: its peers may be waiting for it in a collective, and
    only its connections closing tells them (they then raise, naming it).
    """
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _leave_on_uncaught_exception():
    original = sys.excepthook

    def excepthook(*exc_info):
        original(*exc_info)
        leave_now(1)

    sys.excepthook = excepthook


class PeerWatch:
    """Waits for multi-process executions, turning lost peers into named errors.

    Args:
        task_names: the name of each process id, e.g. ``["chief 0", "worker 0"]``.
        process_id: this process's id.
        timeout_seconds: how long one execution may wait for its peers.
    """

    def __init__(self, task_names, process_id, timeout_seconds):
        self._task_names = list(task_names)
        self._process_id = process_id
        self._timeout = timeout_seconds
        self._requests: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = None
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

    def call(self, fn, *args):
        """``fn(*args)`` run to completion; raises a named error if a peer is lost.

        On CPU a multi-process execution may block in its dispatch, so the call
        itself runs on the watch's thread while the caller waits with the
        deadline. (``fn`` must not depend on the caller's thread-local state:
        it is an already built program.)
        """
        if self._failure is not None:
            raise self._failure
        done = threading.Event()
        box = {}

        def job():
            try:
                box["out"] = jax.block_until_ready(fn(*args))
            except Exception as error:  # handed to the waiting caller
                box["error"] = error
            done.set()

        self._start_thread()
        self._requests.put(job)
        if not done.wait(self._timeout):
            self._fail(None, timed_out=True)
        if "error" in box:
            with self.translating_failures():
                raise box["error"]
        return box["out"]

    def _start_thread(self):
        # The thread may stay blocked for good if a peer never answers: a daemon.
        if self._thread is None:
            self._thread = threading.Thread(target=self._serve, name="keras_dist-peer-watch")
            self._thread.daemon = True
            self._thread.start()

    def _serve(self):
        while True:
            self._requests.get()()

    def _fail(self, cause, timed_out):
        lost = self._missing_peers()
        names = ", ".join(lost) if lost else "an unknown task"
        if timed_out:
            error = DeadlineExceededError(
                f"A collective did not complete within {self._timeout} s: {names} did not "
                "reach it (stuck or dead). The other tasks were waiting for it. Check "
                "that task's log; raise CommunicationOptions(timeout_seconds=...) if a "
                "step legitimately takes longer.",
                lost,
            )
        else:
            error = UnavailableError(
                f"Lost contact with {names} during a collective: the task died or closed "
                f"its connection. Check that task's log. (JAX reported: {cause})",
                lost,
            )
        self._failure = error
        _exit_after_failure()
        raise error from cause

    def _missing_peers(self) -> list:
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
        return [self._task_names[i] for i in missing]


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
