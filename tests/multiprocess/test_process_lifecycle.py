"""Process lifecycle: tasks die with their launcher, SIGTERM and Ctrl-C are honoured promptly,
and a coordinator port already in use is a clear error.

Every cluster runs on 127.0.0.1. Functions of this file reach the tasks by value. Waits poll
with a deadline; a failed wait shows every process's output.
"""

import ctypes
import errno
import os
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time

import pytest

import keras_dist as kd
from keras_dist import _distributed_runtime
from keras_dist import testing
from keras_dist._launch import _bootstrap

BOOTSTRAP = os.path.abspath(_bootstrap.__file__)
# Seconds a JAX cluster of two gets to start (imports included) on a loaded 2-core machine.
START_TIMEOUT = 120

multiprocess = pytest.mark.multiprocess


# --- Helpers -----------------------------------------------------------------------------------


def _wait_for(condition, timeout, describe=lambda: ""):
    """Polls ``condition`` until it holds; raises with ``describe()`` after ``timeout`` s."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError(f"condition not met within {timeout} s\n{describe()}")
        time.sleep(0.02)


def _alive(pid):
    """Whether ``pid`` runs (a zombie, dead but not yet reaped, does not count)."""
    try:
        with open(f"/proc/{pid}/stat") as file:
            return file.read().rpartition(")")[2].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError):
        return False


def _assert_all_die(pids, timeout, describe=lambda: ""):
    try:
        _wait_for(lambda: not any(_alive(pid) for pid in pids), timeout, describe)
    finally:
        for pid in pids:
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)  # Never leave one behind, even when failing.


def _signal_name(signum):
    return signal.Signals(signum).name


def _sigterm_handler_address():
    """The C-level SIGTERM handler (0: SIG_DFL), which ``signal.getsignal`` cannot see."""
    libc = ctypes.CDLL(None, use_errno=True)
    action = ctypes.create_string_buffer(512)
    assert libc.sigaction(signal.SIGTERM, None, action) == 0
    return ctypes.c_void_p.from_buffer(action).value or 0


class _Watched:
    """A process of the test (a launcher); a thread collects its output lines."""

    def __init__(self, command, cwd=None):
        self.popen = subprocess.Popen(
            command,
            cwd=cwd,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )
        self.lines = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self):
        for line in self.popen.stdout:
            self.lines.append(line)

    def output(self):
        return "".join(self.lines)

    def pids(self, marker, count, timeout):
        """The pids printed as ``<marker>=<pid>`` by ``count`` processes."""

        def found():
            return [
                int(line.split(marker + "=")[1].split()[0]) for line in self.lines if marker in line
            ]

        _wait_for(lambda: len(found()) >= count, timeout, self.describe)
        return found()

    def exit_within(self, timeout):
        try:
            return self.popen.wait(timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"still running after {timeout} s\n{self.describe()}") from None

    def describe(self):
        return f"--- output of {self.popen.args} ---\n{self.output()}"

    def close(self):
        if self.popen.poll() is None:
            self.popen.kill()
        self.popen.wait()
        self._reader.join(5)


_SLEEPING_SCRIPT = textwrap.dedent(
    """
    import os, sys, time
    print(f"task pid={os.getpid()} name={__name__} argv={sys.argv[1:]}", flush=True)
    time.sleep(600)
    """
)


@pytest.fixture
def sleeping_script(tmp_path):
    path = tmp_path / "sleep.py"
    path.write_text(_SLEEPING_SCRIPT)
    return str(path)


# --- Tasks die with their launcher --------------------------------------------------------


@multiprocess
@pytest.mark.timeout(90)
@pytest.mark.parametrize("signum", [signal.SIGKILL, signal.SIGHUP], ids=_signal_name)
def test_script_tasks_die_with_the_cli(sleeping_script, signum):
    cli = _Watched(
        [sys.executable, "-m", "keras_dist._launch._cli", "launch", "--workers", "2"]
        + [sleeping_script, "--flag"]
    )
    try:
        pids = cli.pids("task pid", 2, timeout=60)
        os.kill(cli.popen.pid, signum)
        # SIGKILL: the kernel's parent-death signal; SIGHUP: the command stops them itself.
        _assert_all_die(pids, timeout=10, describe=cli.describe)
        code = cli.exit_within(10)
    finally:
        cli.close()
    assert code == (-signal.SIGKILL if signum == signal.SIGKILL else 128 + signum), cli.output()
    assert "name=__main__ argv=['--flag']" in cli.output()


_DRIVER = textwrap.dedent(
    """
    import ctypes, os, sys
    from keras_dist._launch import launch

    def hold_the_gil():
        print(f"task pid={os.getpid()}", flush=True)
        # Sleeps in C holding the GIL: no thread of the task can run, only the kernel
        # can end it.
        ctypes.PyDLL(None).sleep(600)

    def serve():
        import time
        import keras_dist as kd

        kd.MultiWorkerMirroredStrategy()
        print(f"task pid={os.getpid()}", flush=True)
        time.sleep(600)

    def start_a_child():
        import subprocess
        import time

        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
        print(f"task pid={os.getpid()} child pid={child.pid}", flush=True)
        time.sleep(600)

    if __name__ == "__main__":
        fn = {"hold_the_gil": hold_the_gil, "serve": serve, "start_a_child": start_a_child}[
            sys.argv[1]
        ]
        launch(fn, num_workers=2, devices_per_worker=1)
    """
)


@pytest.fixture
def driver(tmp_path):
    path = tmp_path / "driver.py"
    path.write_text(_DRIVER)
    return str(path)


@multiprocess
@pytest.mark.timeout(90)
@pytest.mark.parametrize(
    "signum", [signal.SIGKILL, signal.SIGTERM, signal.SIGHUP], ids=_signal_name
)
def test_function_tasks_die_with_their_launcher_even_holding_the_gil(driver, signum):
    launcher = _Watched([sys.executable, driver, "hold_the_gil"])
    try:
        pids = launcher.pids("task pid", 2, timeout=60)
        os.kill(launcher.popen.pid, signum)
        _assert_all_die(pids, timeout=10, describe=launcher.describe)
        assert launcher.exit_within(10) == -signum
    finally:
        launcher.close()


@multiprocess
@pytest.mark.timeout(90)
def test_what_a_task_started_dies_with_a_sigkilled_launcher(driver):
    # The kernel's parent-death signal reaches the task only; its own children die too.
    launcher = _Watched([sys.executable, driver, "start_a_child"])
    try:
        tasks = launcher.pids("task pid", 2, timeout=60)
        children = launcher.pids("child pid", 2, timeout=60)
        os.kill(launcher.popen.pid, signal.SIGKILL)
        _assert_all_die(tasks + children, timeout=10, describe=launcher.describe)
    finally:
        launcher.close()


def _started_then_wait_for(started_dir, go):
    open(os.path.join(started_dir, str(os.getpid())), "w").close()
    _wait_for(lambda: os.path.exists(go), timeout=60)
    return os.getpid()


@multiprocess
@pytest.mark.timeout(90)
def test_tasks_outlive_the_thread_that_started_them(tmp_path):
    # Linux sends the parent-death signal when the *thread* that started a child ends.
    started, go = tmp_path / "started", tmp_path / "go"
    started.mkdir()
    cluster = testing.create_cluster_spec(num_workers=2)
    with testing.MultiProcessRunner(
        _started_then_wait_for, cluster, args=(str(started), str(go)), stream_output=False
    ) as runner:

        def start_and_wait_until_running():
            runner.start()
            # The tasks run their own code: their parent-death signal is set by now.
            _wait_for(lambda: len(os.listdir(started)) == 2, timeout=60)

        starter = threading.Thread(target=start_and_wait_until_running)
        starter.start()
        starter.join()
        _wait_for(lambda: not os.path.exists(f"/proc/self/task/{starter.native_id}"), 10)
        go.touch()
        results = runner.join(timeout=60)
    assert sorted(results) == sorted(int(name) for name in os.listdir(started))


@multiprocess
@pytest.mark.timeout(60)
def test_the_watch_fallback_kills_a_task_whose_launcher_died(sleeping_script):
    # Where there is no parent-death signal, the bootstrap watches the launcher's pid.
    launcher = _Watched(
        [
            sys.executable,
            "-c",
            "import os, subprocess, sys, time\n"
            f"subprocess.Popen([sys.executable, {BOOTSTRAP!r}, str(os.getpid()), 'watch', "
            f"{sleeping_script!r}, 'a', 'b'])\n"
            "time.sleep(600)",
        ]
    )
    try:
        (pid,) = launcher.pids("task pid", 1, timeout=30)
        assert "name=__main__ argv=['a', 'b']" in launcher.output()
        launcher.popen.kill()
        _assert_all_die([pid], timeout=10, describe=launcher.describe)
    finally:
        launcher.close()


@multiprocess
@pytest.mark.timeout(60)
@pytest.mark.parametrize("mode", ["exec", "watch"])
def test_a_task_whose_launcher_is_already_gone_never_starts(tmp_path, mode):
    marker = tmp_path / "ran"
    script = tmp_path / "task.py"
    script.write_text(f"open({str(marker)!r}, 'w').close()\n")
    flags = ["-I", "-S"] if mode == "exec" else []
    # Launcher pid 1: not this process's parent, as when the launcher died before the fork.
    done = subprocess.run(
        [sys.executable, *flags, BOOTSTRAP, "1", mode, str(script)],
        start_new_session=True,  # The bootstrap kills its own process group.
        timeout=30,
    )
    assert done.returncode == -signal.SIGKILL
    assert not marker.exists()


@multiprocess
@pytest.mark.timeout(60)
def test_the_watch_fallback_runs_a_module_as_python_m_does(tmp_path):
    done = subprocess.run(
        [sys.executable, BOOTSTRAP, str(os.getpid()), "watch", "-m", "calendar", "2024", "2"],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        start_new_session=True,
        timeout=30,
    )
    assert done.returncode == 0, done.stderr
    assert "February 2024" in done.stdout


# --- SIGTERM, Ctrl-C and timeouts with jax.distributed ----------------------------------------


def _join_the_cluster_and_wait():
    kd.MultiWorkerMirroredStrategy()
    print(f"ready sigterm_handler={_sigterm_handler_address()}", flush=True)
    time.sleep(600)


def _logs_of(runner):
    return "\n".join(
        f"--- {key[0]} {key[1]} ---\n{runner.logs(*key)}" for key in runner.process_status()
    )


@multiprocess
@pytest.mark.timeout(240)
def test_sigterm_ends_the_workers_of_a_jax_cluster_within_seconds():
    cluster = testing.create_cluster_spec(num_workers=2)
    with testing.MultiProcessRunner(
        _join_the_cluster_and_wait,
        cluster,
        devices_per_worker=1,
        stream_output=False,
        terminate_grace=60,  # SIGKILL would come only after a minute
    ) as runner:
        runner.start()
        _wait_for(
            lambda: all("ready" in runner.logs("worker", i) for i in (0, 1)),
            START_TIMEOUT,
            lambda: _logs_of(runner),
        )
        started = time.monotonic()
        runner.terminate_all()
        elapsed = time.monotonic() - started
        codes = [status.exit_code for status in runner.process_status().values()]
        logs = _logs_of(runner)
    assert "ready sigterm_handler=0" in logs  # JAX's notifier no longer holds SIGTERM
    assert codes == [-signal.SIGTERM, -signal.SIGTERM], logs
    assert elapsed < 5, logs


def _ends_while_worker_1(what, seconds):
    """Worker 0's program ends at once; worker 1's ``what`` ("fails"/"ends") after ``seconds``."""
    strategy = kd.MultiWorkerMirroredStrategy()
    assert float(strategy.reduce("SUM", strategy.run(lambda: 1.0), axis=None)) == 2.0
    if strategy.cluster_resolver.task_id == 1:
        time.sleep(seconds)
        if what == "fails":
            raise ValueError("worker 1 failed after training")
    print("program ended", flush=True)


@multiprocess
@pytest.mark.timeout(240)
@pytest.mark.parametrize(
    "what, seconds, codes",
    [
        ("fails", 0.0, [0, 1]),  # worker 1 fails before worker 0's program ends
        ("fails", 5.0, [0, 1]),  # ... after, while worker 0 waits to shut down
        ("ends", 5.0, [0, 0]),  # worker 0 waits for worker 1, then both shut down
    ],
)
def test_a_worker_whose_program_ended_exits_when_a_peer_fails(what, seconds, codes):
    # JAX's shutdown waits at a barrier for every process: a peer that failed outside a
    # collective never comes, and worker 0 hung there (TF's worker exits).
    cluster = testing.create_cluster_spec(num_workers=2)
    with testing.MultiProcessRunner(
        _ends_while_worker_1, cluster, args=(what, seconds), stream_output=False
    ) as runner:
        runner.start()
        _wait_for(
            lambda: "program ended" in runner.logs("worker", 0),
            START_TIMEOUT,
            lambda: _logs_of(runner),
        )
        ended = time.monotonic()
        _wait_for(
            lambda: all(s.exit_code is not None for s in runner.process_status().values()),
            seconds + 30,
            lambda: _logs_of(runner),
        )
        waited = time.monotonic() - ended
        logs = _logs_of(runner)
        status = [s.exit_code for s in runner.process_status().values()]
    assert status == codes, logs
    assert waited >= seconds - 1, logs  # worker 0 waited for worker 1's program to end


def _watch_for_preemption():
    from keras_dist.callbacks._preemption import PreemptionWatcher

    kd.MultiWorkerMirroredStrategy()
    watcher = PreemptionWatcher()
    watcher.start()
    during = _sigterm_handler_address()
    print("watching", flush=True)
    deadline = time.monotonic() + 120
    calls = 1
    while not watcher.reached_sync_point():
        if time.monotonic() > deadline:
            raise TimeoutError("no preemption sync point within 120 s")
        calls += 1
        time.sleep(0.02)
    watcher.finish()
    return {"calls": calls, "during": during != 0, "after": _sigterm_handler_address()}


@multiprocess
@pytest.mark.timeout(240)
def test_a_preemption_watcher_on_several_processes_still_hears_sigterm():
    cluster = testing.create_cluster_spec(num_workers=2)
    with testing.MultiProcessRunner(
        _watch_for_preemption, cluster, devices_per_worker=1, stream_output=False
    ) as runner:
        runner.start()
        _wait_for(
            lambda: all("watching" in runner.logs("worker", i) for i in (0, 1)),
            START_TIMEOUT,
            lambda: _logs_of(runner),
        )
        os.kill(runner.process_status()[("worker", 1)].pid, signal.SIGTERM)
        results = runner.join(timeout=START_TIMEOUT)
    # Worker 1 survived its SIGTERM (JAX's notifier had it), and both stopped at one step.
    assert results[0]["calls"] == results[1]["calls"], results
    assert all(r["during"] and r["after"] == 0 for r in results), results


@multiprocess
@pytest.mark.timeout(240)
def test_ctrl_c_stops_a_two_worker_launch_within_5_s(driver):
    launcher = _Watched([sys.executable, driver, "serve"])
    pids = []
    try:
        pids = launcher.pids("task pid", 2, timeout=START_TIMEOUT)
        started = time.monotonic()
        os.kill(launcher.popen.pid, signal.SIGINT)
        launcher.exit_within(30)
        elapsed = time.monotonic() - started
        assert not any(_alive(pid) for pid in pids), launcher.describe()
    finally:
        launcher.close()
        _assert_all_die(pids, timeout=10)
    assert elapsed < 5, launcher.describe()


@multiprocess
@pytest.mark.timeout(240)
def test_launch_timeout_is_honoured_within_seconds():
    timeout = 25  # Long enough for both workers to start jax.distributed under load.
    started = time.monotonic()
    with pytest.raises(testing.SubprocessTimeoutError) as info:
        kd.launch(
            _join_the_cluster_and_wait,
            num_workers=2,
            devices_per_worker=1,
            timeout=timeout,
            stream_output=False,
        )
    elapsed = time.monotonic() - started
    assert all("ready" in log for log in info.value.logs.values()), str(info.value)
    assert set(info.value.exit_codes.values()) == {-signal.SIGTERM}, str(info.value)
    assert elapsed < timeout + 5, str(info.value)


# --- A coordinator port already in use -------------------------------------------------------


def _create_the_strategy():
    from jax._src import xla_bridge

    try:
        kd.MultiWorkerMirroredStrategy()
    except OSError as error:
        return {
            "errno": error.errno,
            "message": str(error),
            "jax_started": xla_bridge.backends_are_initialized()
            or _distributed_runtime.is_initialized(),
        }
    return None


@multiprocess
@pytest.mark.timeout(120)
def test_a_coordinator_port_in_use_is_an_error_naming_it():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        address = f"127.0.0.1:{taken.getsockname()[1]}"
        cluster = {"worker": [address, f"127.0.0.1:{testing.pick_unused_port()}"]}
        with testing.MultiProcessRunner(
            _create_the_strategy, cluster, devices_per_worker=1, stream_output=False
        ) as runner:
            started = time.monotonic()
            runner.start_single_process("worker", 0)  # Worker 1 would wait for it in vain.
            (result, _) = runner.join(timeout=60)
            elapsed = time.monotonic() - started
            log = runner.logs("worker", 0)
    assert result is not None, f"the strategy was created on a taken port\n{log}"
    assert result["errno"] == errno.EADDRINUSE, log
    assert f"The coordinator address {address} (hosted by worker 0" in result["message"]
    assert "already in use" in result["message"]
    assert not result["jax_started"], log
    assert elapsed < 60, log


def test_the_port_check_ignores_an_earlier_coordinators_closed_connections():
    # gRPC binds with SO_REUSEADDR: connections it closed (TIME_WAIT) do not stop it.
    with socket.socket() as listener:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        port = listener.getsockname()[1]
        client = socket.create_connection(("127.0.0.1", port))
        accepted, _ = listener.accept()
        accepted.close()  # The server side closes first: it keeps the port in TIME_WAIT.
        client.recv(1)
        client.close()
    _distributed_runtime.check_coordinator_port(f"127.0.0.1:{port}", "worker 0")


def test_the_port_check_sees_a_bound_socket_that_does_not_listen():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        address = f"127.0.0.1:{taken.getsockname()[1]}"
        with pytest.raises(OSError, match=f"The coordinator address {address} is") as info:
            _distributed_runtime.check_coordinator_port(address)
    assert info.value.errno == errno.EADDRINUSE


def test_sigterm_goes_to_jaxs_notifier_only_while_a_preemption_save_asks(monkeypatch):
    # Stands JAX's notifier in with SIG_IGN's action: the hand-over is raw sigaction.
    assert _distributed_runtime.hand_sigterm_to_preemption_notifier()() is None  # no JAX here
    previous = signal.signal(signal.SIGTERM, signal.SIG_IGN)
    try:
        notifier = _distributed_runtime._sigaction(signal.SIGTERM)
    finally:
        signal.signal(signal.SIGTERM, previous)
    monkeypatch.setattr(_distributed_runtime, "_notifier_sigterm", notifier)
    before = _sigterm_handler_address()
    first = _distributed_runtime.hand_sigterm_to_preemption_notifier()
    second = _distributed_runtime.hand_sigterm_to_preemption_notifier()
    assert _sigterm_handler_address() == int(signal.SIG_IGN)
    first()
    first()  # Undoing twice counts once.
    assert _sigterm_handler_address() == int(signal.SIG_IGN)
    second()
    assert _sigterm_handler_address() == before
    assert signal.getsignal(signal.SIGTERM) is previous
