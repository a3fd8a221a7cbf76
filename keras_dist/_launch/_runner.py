"""``MultiProcessRunner``: one supervised process per task of a cluster.

Modelled on TF's ``multi_process_runner.MultiProcessRunner``. A monitor thread watches the
tasks: it restarts failed tasks (``auto_restart``), and once a task has failed (or the chief
has exited, with ``dependence_on_chief``) it gives the others ``failure_grace`` seconds to
finish or report their own error, then stops them. ``join`` waits and raises what went wrong.
"""

import os
import shutil
import tempfile
import threading
import time
import weakref

from keras_dist._launch import _blame
from keras_dist._launch import _process
from keras_dist._launch._cluster import task_keys
from keras_dist._launch._cluster import tf_config
from keras_dist._launch._env import child_environment
from keras_dist._launch._env import devices_by_task
from keras_dist._launch._errors import SubprocessTimeoutError
from keras_dist._launch._errors import UnexpectedSubprocessExitError
from keras_dist._launch._errors import format_logs
from keras_dist._launch._errors import remote_error
from keras_dist._launch._hosts import host_prefixes
from keras_dist._launch._program import FunctionProgram
from keras_dist._launch._program import ScriptProgram
from keras_dist._launch._task_slot import TaskSlot
from keras_dist._launch._task_slot import TaskStatus

_CHIEF = ("chief", 0)
_POLL_INTERVAL = 0.05


class MultiProcessRunner:
    """Runs ``fn(*args, **kwargs)`` in one process per task of ``cluster_spec``.

    Each task's process gets ``TF_CONFIG`` with the cluster and its own task, so a strategy
    created there (``MultiWorkerMirroredStrategy``) finds its peers. ``fn`` travels with
    cloudpickle: functions of scripts, notebooks and test files are sent by value.

    Args:
        fn: The function each task calls. Its return value must be picklable.
        cluster_spec: ``{"chief": [...], "worker": [...]}``, as from ``create_cluster_spec``.
        args: Positional arguments of ``fn``.
        kwargs: Keyword arguments of ``fn``.
        max_run_time: Seconds after ``start()`` when every task is stopped and ``join``
            raises ``SubprocessTimeoutError``; ``None`` for no limit.
        env: Environment variables for every task, over the inherited ones.
        devices_per_worker: Simulated CPU devices per task (``JAX_PLATFORMS=cpu``), or one
            count per task in ``task_keys`` order (chief, workers, then ps) for tasks with
            different device counts; by default a task has one CPU device even when this
            process simulates several.
        auto_restart: Restart a task that fails (non-zero exit or an exception), with the
            same ``TF_CONFIG``.
        max_restarts: Restarts allowed per task with ``auto_restart``; ``None`` for no limit
            (as TF).
        stream_output: Print each line of each task as it comes, prefixed ``[worker 1] ``.
            Every task's output is also kept: see ``logs``.
        dependence_on_chief: When the chief exits, stop the other tasks (after
            ``failure_grace``).
        survivable: Task types the job goes on without while one of the type runs (a
            parameter-server job's ``"worker"``): the failed task is ``"lost"``, no error.
        failure_grace: Seconds the other tasks get, after a task failed or the chief exited,
            to finish or to report their own error, before they are stopped.
        terminate_grace: Seconds between SIGTERM and SIGKILL when a task is stopped.
        log_dir: Folder for the log files (``<task_type>-<task_id>.log``); by default a
            temporary folder removed with the runner.
        host_command: Starts each task on the host of its address (``ssh {host}``: see
            ``_hosts``); by default every task runs here.

    >>> def where_am_i():
    ...     import json, os
    ...     return json.loads(os.environ["TF_CONFIG"])["task"]
    >>> from keras_dist.testing import create_cluster_spec
    >>> cluster = create_cluster_spec(has_chief=True, num_workers=1)
    >>> with MultiProcessRunner(where_am_i, cluster, stream_output=False) as runner:
    ...     runner.start()
    ...     runner.join(timeout=60)
    [{'type': 'chief', 'index': 0}, {'type': 'worker', 'index': 0}]

    A task that raises re-raises here with its own type, its traceback, and the end of every
    task's log; a task that exits without a result raises ``UnexpectedSubprocessExitError``.
    No process outlives the runner: leaving the ``with`` block, garbage collection and the
    end of the interpreter stop any that remain, and a process killed outright (SIGKILL)
    takes its tasks along (Linux's parent-death signal; elsewhere a watch on its pid).
    """

    def __init__(
        self,
        fn,
        cluster_spec: dict,
        *,
        args=(),
        kwargs: dict | None = None,
        max_run_time: float | None = None,
        env: dict[str, str] | None = None,
        devices_per_worker: "int | list[int] | None" = None,
        auto_restart: bool = False,
        max_restarts: int | None = None,
        stream_output: bool = True,
        dependence_on_chief: bool = True,
        survivable: tuple = (),
        failure_grace: float = 30.0,
        terminate_grace: float = 10.0,
        log_dir: str | None = None,
        host_command: str | None = None,
    ):
        _check_seconds(max_run_time=max_run_time, allow_none=True)
        _check_seconds(failure_grace=failure_grace, terminate_grace=terminate_grace)
        if max_restarts is not None and (not isinstance(max_restarts, int) or max_restarts < 0):
            raise ValueError(
                "`max_restarts` must be None or a non-negative integer. "
                f"Received: max_restarts={max_restarts!r}"
            )
        # A ScriptProgram (from the `keras-dist launch` command) runs a script instead.
        self._program = fn if isinstance(fn, ScriptProgram) else FunctionProgram(fn, args, kwargs)
        keys = task_keys(cluster_spec)
        self._cluster_spec = cluster_spec
        self._max_run_time = max_run_time
        self._env = dict(env or {})
        self._devices = devices_by_task(devices_per_worker, keys)
        self._host_prefixes = host_prefixes(cluster_spec, host_command)
        self._auto_restart = auto_restart
        self._max_restarts = max_restarts
        self._dependence_on_chief = dependence_on_chief
        self._survivable = tuple(survivable)
        self._stream_output = stream_output
        self._failure_grace = failure_grace
        self._terminate_grace = terminate_grace
        # Check the environment now rather than in start().
        child_environment(
            tf_config(cluster_spec, *keys[0]), devices_per_worker=self._devices[keys[0]], env=env
        )

        self._workdir = tempfile.mkdtemp(prefix="keras_dist_run_")
        self._program.setup(self._workdir)
        log_dir = log_dir or self._workdir
        os.makedirs(log_dir, exist_ok=True)
        self._slots = {
            key: TaskSlot(
                _process.TaskProcess(
                    *key, os.path.join(log_dir, f"{key[0]}-{key[1]}.log"), stream_output
                )
            )
            for key in keys
        }
        # Runs when the runner is garbage collected or the interpreter exits, whichever is first.
        processes = [slot.process for slot in self._slots.values()]
        self._finalizer = weakref.finalize(self, _clean_up, processes, self._workdir)

        self._lock = threading.RLock()
        self._started_at = None
        self._stop_at = None  # When the remaining tasks get stopped (after failure_grace).
        self._stopping = False  # terminate_all() was called: no more restarts.
        self._timeout_reason = None
        self._monitor = None
        self._closed = False

    # --- Starting and stopping -------------------------------------------------------------

    def start(self) -> None:
        """Starts every task. Raises ``ValueError`` when called twice."""
        with self._lock:
            if self._started_at is not None:
                raise ValueError("This MultiProcessRunner was started already.")
            self._started_at = time.monotonic()
            for key in self._slots:
                self._start(key)
        self._start_monitor()

    def start_single_process(self, task_type: str, task_id: int) -> None:
        """Starts one task of the cluster (again, after it ended or was terminated).

        Raises ``ValueError`` when that task is running.
        """
        key = self._key(task_type, task_id)
        with self._lock:
            if self._slots[key].process.running():
                raise ValueError(f"Task {task_type} {task_id} is running already.")
            if self._started_at is None:
                self._started_at = time.monotonic()
            # A manual start is a new beginning: no pending stop from an earlier failure.
            self._stopping = False
            self._stop_at = None
            self._start(key)
        self._start_monitor()

    def terminate(self, task_type: str, task_id: int, grace: float | None = None) -> None:
        """Stops one task: SIGTERM to its process group, SIGKILL after ``grace`` seconds.

        ``grace`` defaults to the runner's ``terminate_grace``. Returns once it has exited;
        a terminated task is not restarted and is not a failure (its result is ``None``).
        """
        self._stop_one(task_type, task_id, lambda p: _process.terminate(p, self._grace(grace)))

    def kill(self, task_type: str, task_id: int) -> None:
        """Stops one task now with SIGKILL (to its process group), as a crash would."""
        self._stop_one(task_type, task_id, _process.kill)

    def _stop_one(self, task_type: str, task_id: int, stop) -> None:
        with self._lock:
            slot = self._slots[self._key(task_type, task_id)]
            slot.stopped = slot.process.running()
        stop([slot.process])
        with self._lock:
            self._collect_exits()

    def terminate_all(self, grace: float | None = None) -> None:
        """Stops every running task (SIGTERM, then SIGKILL after ``grace``); no more restarts."""
        with self._lock:
            self._stopping = True
            processes = []
            for slot in self._slots.values():
                if slot.process.running():
                    slot.stopped = True
                    processes.append(slot.process)
        _process.terminate(processes, self._grace(grace))
        with self._lock:
            self._collect_exits()

    def close(self) -> None:
        """Stops any running task and the monitor; the logs stay readable."""
        with self._lock:
            running = any(slot.process.running() for slot in self._slots.values())
        if running:
            self.terminate_all()
        self._closed = True
        if self._monitor is not None and self._monitor is not threading.current_thread():
            self._monitor.join()

    def __enter__(self) -> "MultiProcessRunner":
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    # --- Waiting and results -----------------------------------------------------------------

    def join(self, timeout: float | None = None) -> list:
        """Waits for every started task; returns their return values, chief first.

        A task that was terminated, or that exited without a result, gives ``None``.

        Raises:
            SubprocessTimeoutError: ``timeout`` or ``max_run_time`` passed; every task was
                stopped.
            UnexpectedSubprocessExitError: a task exited non-zero or was killed (not by the
                runner) without raising.
            WorkerError: a task's function raised. The error is an instance of the task's
                exception type too, when that type can be rebuilt here.

        The first task that failed decides the error (see ``_blame``); every message ends
        with the end of every task's log.
        """
        _check_seconds(timeout=timeout, allow_none=True)
        if self._started_at is None:
            raise ValueError("Call start() before join().")
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            self._supervise()
            with self._lock:
                if all(slot.exit_code is not None for slot in self._slots.values() if slot.started):
                    break
            if deadline is not None and time.monotonic() >= deadline:
                with self._lock:
                    self._timeout_reason = (
                        self._timeout_reason or f"join's timeout of {timeout:g} s"
                    )
                self.terminate_all()
                continue
            time.sleep(_POLL_INTERVAL)
        return self._results_or_raise()

    def logs(self, task_type: str, task_id: int) -> str:
        """Everything the task printed so far (stdout and stderr, every restart)."""
        return self._slots[self._key(task_type, task_id)].process.log_text()

    def exit_code(self, task_type: str, task_id: int) -> int | None:
        """The task's exit code; ``None`` while it runs or before it started."""
        key = self._key(task_type, task_id)
        with self._lock:
            self._collect_exits()
            return self._slots[key].exit_code

    def process_status(self) -> dict[tuple[str, int], TaskStatus]:
        """Each task's ``TaskStatus``, keyed by ``(task_type, task_id)``, in task order."""
        with self._lock:
            self._collect_exits()
            return {
                key: TaskStatus(
                    slot.state, slot.exit_code, slot.process.pid, max(slot.starts - 1, 0)
                )
                for key, slot in self._slots.items()
            }

    # --- Supervision -------------------------------------------------------------------------

    def _start(self, key) -> None:
        slot = self._slots[key]
        self._program.clear(*key)
        env = child_environment(
            tf_config(self._cluster_spec, *key),
            devices_per_worker=self._devices[key],
            env=self._env,
        )
        banner = None
        if slot.started:
            banner = (
                f"----- keras-dist: {slot.process.name} restarted (restart {slot.starts}) -----"
            )
        slot.process.start(self._program.command(*key), env, banner, self._host_prefixes[key])
        slot.starts += 1
        slot.exit_code = None
        slot.outcome = None
        slot.stopped = False
        slot.failed_at = None
        slot.survived = False

    def _start_monitor(self) -> None:
        if self._monitor is None or not self._monitor.is_alive():
            self._monitor = threading.Thread(
                target=_watch,
                args=(weakref.WeakMethod(self._monitor_round),),
                name="keras-dist-monitor",
                daemon=True,
            )
            self._monitor.start()

    def _monitor_round(self) -> bool:
        """One round of the monitor thread: supervises, unless closed; whether to go on."""
        if self._closed:
            return False
        self._supervise()
        return True

    def _supervise(self) -> None:
        """Notes exits, restarts failed tasks, and stops everything when it is time."""
        with self._lock:
            self._collect_exits()
            if self._stopping or self._started_at is None:
                return
            now = time.monotonic()
            over_time = (
                self._max_run_time is not None and now >= self._started_at + self._max_run_time
            )
            if over_time:
                self._timeout_reason = f"max_run_time of {self._max_run_time:g} s"
            elif self._stop_at is None or now < self._stop_at:
                return
        self.terminate_all()

    def _collect_exits(self) -> None:
        now = time.monotonic()
        for key, slot in self._slots.items():
            if not slot.started or slot.exit_code is not None:
                continue
            code = slot.process.poll()
            if code is None:
                continue
            slot.process.finish()
            slot.exit_code = code
            slot.outcome = self._program.read_outcome(*key)
            if slot.stopped:
                continue
            if code == 0 and slot.outcome.failure is None:
                if key == _CHIEF and self._dependence_on_chief:
                    self._stop_rest(now)
                continue
            if self._may_restart(slot):
                self._start(key)
                continue
            slot.failed_at = slot.process.exited_at()  # its own time, not this round's
            if self._survives(key):
                slot.survived = True
                continue
            self._stop_rest(now)

    def _survives(self, key) -> bool:
        """Whether the job goes on without task ``key`` (announced when it does)."""
        running = [k for k, s in self._slots.items() if k[0] == key[0] and s.state == "running"]
        if key[0] not in self._survivable or not running:
            return False
        if self._stream_output:
            how = _process.describe_exit(self._slots[key].exit_code)
            print(f"[keras-dist] {key[0]} {key[1]} failed ({how}); the job goes on without it.")
        return True

    def _may_restart(self, slot: TaskSlot) -> bool:
        return (
            self._auto_restart
            and not self._stopping
            and self._stop_at is None
            and (self._max_restarts is None or slot.starts - 1 < self._max_restarts)
        )

    def _stop_rest(self, now: float) -> None:
        if self._stop_at is None:
            self._stop_at = now + self._failure_grace

    # --- Reporting ---------------------------------------------------------------------------

    def _results_or_raise(self) -> list:
        with self._lock:
            report = self._report()
            failed = [
                _blame.Failure(key, slot.failed_at, slot.exit_code, slot.process.log_tail())
                for key, slot in self._slots.items()
                if slot.failed_at is not None and not slot.survived
            ]
            if failed:
                raise self._failure_error(_blame.first_failure(failed), report)
            if self._timeout_reason is not None:
                raise SubprocessTimeoutError(
                    f"The tasks did not finish within the {self._timeout_reason}; every task "
                    f"was stopped (SIGTERM, then SIGKILL after {self._terminate_grace} s).\n\n"
                    f"{self._log_section()}",
                    **report,
                )
            return report["results"]

    def _failure_error(self, key, report: dict) -> BaseException:
        slot = self._slots[key]
        name = slot.process.name
        failure = slot.outcome.failure
        if failure is not None:
            message = (
                f"{name} raised {failure.type_name}: {failure.message}\n\n"
                f"{failure.traceback}\n{self._log_section()}"
            )
            return remote_error(failure, message, task_type=key[0], task_id=key[1], **report)
        returned = ""
        if self._program.returns_values:
            returned = " after returning" if slot.returned else " without a result"
        return UnexpectedSubprocessExitError(
            f"{name} exited unexpectedly ({_process.describe_exit(slot.exit_code)}){returned}."
            f"\n\n{self._log_section()}",
            task_type=key[0],
            task_id=key[1],
            **report,
        )

    def _report(self) -> dict:
        slots = self._slots.items()
        return {
            "results": [slot.outcome.value if slot.returned else None for _, slot in slots],
            "exit_codes": {key: slot.exit_code for key, slot in slots},
            "logs": {key: slot.process.log_text() for key, slot in slots},
        }

    def _log_section(self) -> str:
        entries = []
        for slot in self._slots.values():
            status = slot.state
            if slot.exit_code is not None:
                status += f", {_process.describe_exit(slot.exit_code)}"
            entries.append((slot.process.name, status, slot.process.log_text()))
        return format_logs(entries)

    def _key(self, task_type: str, task_id: int) -> tuple[str, int]:
        key = (task_type, task_id)
        if key not in self._slots:
            raise ValueError(
                f"The cluster has no task {task_type} {task_id}. Its tasks: "
                f"{list(self._slots)}. Received: task_type={task_type!r}, task_id={task_id!r}"
            )
        return key

    def _grace(self, grace: float | None) -> float:
        if grace is None:
            return self._terminate_grace
        _check_seconds(grace=grace)
        return grace


def _watch(weak_round) -> None:
    """The monitor thread's loop. It holds the runner weakly (a ``WeakMethod``): an
    abandoned runner is still garbage collected, and its tasks stopped."""
    while True:
        monitor_round = weak_round()
        if monitor_round is None or not monitor_round():
            return
        del monitor_round  # the runner is not held while the thread sleeps
        time.sleep(_POLL_INTERVAL)


def _clean_up(processes, workdir) -> None:
    _process.kill_now(processes)
    shutil.rmtree(workdir, ignore_errors=True)


def _check_seconds(allow_none: bool = False, **values) -> None:
    for name, value in values.items():
        if value is None and allow_none:
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
            raise ValueError(
                f"`{name}` must be a number of seconds >= 0. Received: {name}={value!r}"
            )
