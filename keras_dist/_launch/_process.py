"""One task's operating-system process: its own session, a log file, prefixed live output.

Each task runs in a new session (so its own process group): signals reach the task and
everything it started, and a Ctrl-C in the terminal reaches only the launcher, which then
stops the tasks in order. Stopping escalates from SIGTERM to SIGKILL after a grace period
(a task may handle SIGTERM: a preemption save, or code of its own).

Tasks die with the launcher however it ends, SIGKILL included: every task starts through
``_bootstrap``, which on Linux asks the kernel for SIGKILL when the launcher dies (the
parent-death signal) and elsewhere watches the launcher's pid. Linux sends that signal when
the *thread* that started the child ends, so children are started from the main thread, or
from one spawner thread that lives as long as the process.

Each process also has a thread that waits for it and notes when it exited: when one task
dies and its peers fail because of it, the launcher blames the one that exited first, and
a poll loop would see several exits at once (see ``_blame``).
"""

import concurrent.futures
import os
import queue
import signal
import subprocess
import sys
import threading
import time

from keras_dist._launch import _bootstrap
from keras_dist._launch._hosts import on_host

_BOOTSTRAP_PATH = os.path.abspath(_bootstrap.__file__)

# One lock for every task's output, so that lines of different tasks never interleave.
_OUTPUT_LOCK = threading.Lock()
# How long a finished task's output may take to drain after the process is gone.
_DRAIN_TIMEOUT = 5.0


class TaskProcess:
    """The process of one task (restartable): output to ``log_path``, optionally streamed.

    Streamed lines go to ``sys.stdout`` as it is when the line arrives, prefixed with the
    task (``[worker 1] ``), which also works where ``sys.stdout`` is a notebook's stream.
    """

    def __init__(self, task_type: str, task_id: int, log_path: str, stream_output: bool):
        self.task_type = task_type
        self.task_id = task_id
        self.log_path = log_path
        self._stream_output = stream_output
        self.popen: subprocess.Popen | None = None
        self._reader: threading.Thread | None = None
        self._exit_clock: _ExitClock | None = None

    @property
    def name(self) -> str:
        return f"{self.task_type} {self.task_id}"

    @property
    def pid(self) -> int | None:
        return None if self.popen is None else self.popen.pid

    def start(self, command, env, banner: str | None = None, host_prefix=()) -> None:
        """Starts (or restarts) the task; ``banner`` is a line for the log before its output.

        ``host_prefix`` (``ssh host``...) starts it on a host of its own (``_hosts``).
        """
        log = open(self.log_path, "ab")  # Closed by the reader thread, at the end of output.
        if banner:
            log.write(f"{banner}\n".encode())
            log.flush()
            self._stream(f"{banner}\n")
        try:
            if host_prefix:
                command = on_host(list(host_prefix), _BOOTSTRAP_PATH, command, env)
            else:
                command = with_bootstrap(command)
            self.popen = _popen(
                command,
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        except BaseException:
            log.close()
            raise
        self._exit_clock = _ExitClock(
            self.popen, f"keras-dist-wait-{self.task_type}-{self.task_id}"
        )
        self._reader = threading.Thread(
            target=self._pump,
            args=(self.popen.stdout, log),
            name=f"keras-dist-output-{self.task_type}-{self.task_id}",
            daemon=True,
        )
        self._reader.start()

    def poll(self) -> int | None:
        """The exit code (negative: killed by that signal), or None while running."""
        return None if self.popen is None else self.popen.poll()

    def exited_at(self) -> float | None:
        """When the process exited (``time.monotonic()``); ``None`` while it runs."""
        if self._exit_clock is None or self.poll() is None:
            return None
        return self._exit_clock.read()

    def running(self) -> bool:
        return self.popen is not None and self.popen.poll() is None

    def send(self, signum: int) -> None:
        """Sends ``signum`` to the task's process group (the task and what it started)."""
        if self.popen is None:
            return
        try:
            os.killpg(self.popen.pid, signum)
        except (ProcessLookupError, PermissionError):
            pass  # The whole group is gone already.

    def finish(self) -> None:
        """After the task exited: kills what it left behind and waits for its output."""
        # Processes the task started would keep the output pipe (and resources) open.
        self.send(signal.SIGKILL)
        if self._reader is not None:
            self._reader.join(_DRAIN_TIMEOUT)

    def log_text(self) -> str:
        try:
            with open(self.log_path, "rb") as file:
                return file.read().decode("utf-8", errors="replace")
        except FileNotFoundError:
            return ""

    def log_tail(self, size: int = 8192) -> str:
        """The last ``size`` bytes of the log (where a failed task says what it lost)."""
        try:
            with open(self.log_path, "rb") as file:
                file.seek(max(file.seek(0, os.SEEK_END) - size, 0))
                return file.read().decode("utf-8", errors="replace")
        except FileNotFoundError:
            return ""

    def _pump(self, pipe, log) -> None:
        with pipe, log:
            for line in iter(pipe.readline, b""):
                log.write(line)
                log.flush()
                if self._stream_output:
                    self._stream(line.decode("utf-8", errors="replace"))

    def _stream(self, text: str) -> None:
        if not self._stream_output or sys.stdout is None:
            return
        if not text.endswith("\n"):
            text += "\n"
        with _OUTPUT_LOCK:
            try:
                sys.stdout.write(f"[{self.name}] {text}")
                sys.stdout.flush()
            except (OSError, ValueError):
                pass  # The stream was closed (the interpreter is shutting down).


class _ExitClock:
    """Notes when one process exits, from a thread that waits for nothing else.

    The thread holds ``Popen``'s wait lock while it waits, so ``poll()`` elsewhere reports
    the exit only once the thread has reaped the process; ``read`` then waits the instant
    it takes the thread to note the time. A daemon: it never keeps the interpreter alive.
    """

    def __init__(self, popen: subprocess.Popen, name: str):
        self._at = None
        self._thread = threading.Thread(target=self._wait, args=(popen,), name=name, daemon=True)
        self._thread.start()

    def _wait(self, popen: subprocess.Popen) -> None:
        popen.wait()
        self._at = time.monotonic()

    def read(self) -> float:
        """The exit's time; call it once the process has exited."""
        self._thread.join()
        return self._at


def with_bootstrap(command: list[str]) -> list[str]:
    """``command`` (``[sys.executable, ARGS...]``) started through ``_bootstrap``.

    >>> command = with_bootstrap([sys.executable, "train.py", "--epochs", "3"])
    >>> command[-3:], command[-4] in ("exec", "watch")
    (['train.py', '--epochs', '3'], True)
    """
    if not command or command[0] != sys.executable:
        raise ValueError(
            f"A task's command must start with this interpreter ({sys.executable}). "
            f"Received: command={command!r}"
        )
    launcher = str(os.getpid())
    if sys.platform.startswith("linux"):
        # Isolated and without site-packages: the bootstrap needs only the standard library,
        # and it replaces itself with the task at once.
        return [sys.executable, "-I", "-S", _BOOTSTRAP_PATH, launcher, "exec", *command[1:]]
    return [sys.executable, _BOOTSTRAP_PATH, launcher, "watch", *command[1:]]


_spawn_requests: queue.SimpleQueue = queue.SimpleQueue()
_spawner: threading.Thread | None = None
_spawner_lock = threading.Lock()


def _popen(command: list[str], **kwargs) -> subprocess.Popen:
    """``subprocess.Popen`` from a thread that ends only with this process.

    The parent-death signal fires when the thread that forked the child ends: a task
    started from a passing thread (a restart from the runner's monitor, ``start()`` in a
    thread of the user's) would be killed when that thread returns.
    """
    if threading.current_thread() is threading.main_thread():
        return subprocess.Popen(command, **kwargs)
    global _spawner
    with _spawner_lock:
        if _spawner is None or not _spawner.is_alive():
            # A daemon: it waits for requests for the rest of the process's life.
            _spawner = threading.Thread(target=_serve_spawns, name="keras-dist-spawner")
            _spawner.daemon = True
            _spawner.start()
    started: concurrent.futures.Future = concurrent.futures.Future()
    _spawn_requests.put((started, command, kwargs))
    return started.result()


def _serve_spawns() -> None:
    while True:
        started, command, kwargs = _spawn_requests.get()
        try:
            started.set_result(subprocess.Popen(command, **kwargs))
        except BaseException as error:  # handed to the waiting caller
            started.set_exception(error)


def terminate(processes: list[TaskProcess], grace: float) -> None:
    """SIGTERM to each process group; SIGKILL to those still running after ``grace`` seconds.

    Returns when every process has exited.
    """
    running = [process for process in processes if process.running()]
    for process in running:
        process.send(signal.SIGTERM)
    deadline = time.monotonic() + grace
    while running and time.monotonic() < deadline:
        time.sleep(0.02)
        running = [process for process in running if process.running()]
    for process in running:
        process.send(signal.SIGKILL)
    for process in running:
        process.popen.wait()


def kill(processes: list[TaskProcess]) -> None:
    """SIGKILL to each process group, as a crash would; returns when every process has exited."""
    running = [process for process in processes if process.running()]
    for process in running:
        process.send(signal.SIGKILL)
    for process in running:
        process.popen.wait()


def kill_now(processes: list[TaskProcess]) -> None:
    """SIGKILL to every running process group, without waiting (for clean-up at exit)."""
    for process in processes:
        if process.running():
            process.send(signal.SIGKILL)


def describe_exit(code: int | None) -> str:
    """``"exit code 3"``, ``"killed by SIGKILL"``, or ``"running"``.

    >>> describe_exit(3), describe_exit(-9), describe_exit(None)
    ('exit code 3', 'killed by SIGKILL', 'running')
    """
    if code is None:
        return "running"
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"
