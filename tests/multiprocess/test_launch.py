"""Local multi-process launching with real processes: the runner, ``launch`` and the CLI.

The tasks here run plain Python (no ``jax.distributed``), so each test takes a second or two.
Functions of this file reach the tasks by value (the tasks cannot import a test file).
"""

import gc
import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from keras_dist import testing
from keras_dist._launch import launch
from keras_dist._launch._cli import main as cli_main

pytestmark = [pytest.mark.timeout(60), pytest.mark.multiprocess]


# --- Functions the tasks run -------------------------------------------------------------------


def _task():
    return json.loads(os.environ["TF_CONFIG"])["task"]


def _describe(offset, scale=1):
    config = json.loads(os.environ["TF_CONFIG"])
    return {
        "tf_config": config,
        "value": offset + scale * config["task"]["index"],
        "env": {k: os.environ.get(k) for k in ("XLA_FLAGS", "KERAS_BACKEND", "PYTHONUNBUFFERED")},
    }


def _devices():
    import jax

    return len(jax.devices()), os.environ.get("JAX_PLATFORMS")


class _CustomError(Exception):
    pass


class _TwoArgumentError(Exception):
    # Unpickling calls __init__ with one argument, so the parent cannot rebuild it.
    def __init__(self, what, why):
        super().__init__(f"{what} because {why}")


def _raise_on_worker_1(error_type, *error_args):
    print(f"{_task()['type']} {_task()['index']} says hi", flush=True)
    if _task() == {"type": "worker", "index": 1}:
        raise error_type(*error_args)
    return _task()["index"]


def _exit_3_on_worker_1():
    print(f"{_task()['type']} {_task()['index']} says hi", flush=True)
    if _task()["index"] == 1:
        os._exit(3)
    return "ok"


def _ignore_sigterm_and_sleep():
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    print("ignoring SIGTERM", flush=True)
    time.sleep(600)


def _sleep():
    print("sleeping", flush=True)
    time.sleep(600)


def _chief_returns_worker_sleeps():
    if _task()["type"] == "chief":
        return "chief done"
    _sleep()


def _chief_marks_worker_waits(marker):
    if _task()["type"] == "chief":
        open(marker, "w").close()
        return "chief done"
    _wait_for(lambda: os.path.exists(marker), timeout=30)
    return "worker done"


def _fail_first_run_of_worker_1(marker_dir, how):
    task = _task()
    marker = os.path.join(marker_dir, f"{task['type']}-{task['index']}")
    if task == {"type": "worker", "index": 1} and not os.path.exists(marker):
        with open(marker, "w") as file:
            file.write(os.environ["TF_CONFIG"])
        if how == "exit":
            os._exit(5)
        raise RuntimeError("first run fails")
    return json.loads(os.environ["TF_CONFIG"])


def _always_exit_7():
    os._exit(7)


def _print_lines():
    task = _task()
    print(f"stdout of {task['index']}")
    print(f"stderr of {task['index']}", file=sys.stderr)
    return task["index"]


# --- Helpers ---------------------------------------------------------------------------------


def _wait_for(condition, timeout):
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError("condition not met in time")
        time.sleep(0.02)


def _alive(pid):
    """Whether ``pid`` runs (a zombie, dead but not yet reaped, does not count)."""
    try:
        import psutil
    except ImportError:
        try:
            with open(f"/proc/{pid}/stat") as file:
                return file.read().rpartition(")")[2].split()[0] != "Z"
        except FileNotFoundError:
            return False
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _descendants():
    try:
        import psutil
    except ImportError:
        return _descendants_from_proc()
    return {child.pid for child in psutil.Process().children(recursive=True)}


def _descendants_from_proc():
    parents = {}
    for entry in os.listdir("/proc"):
        try:
            with open(f"/proc/{entry}/stat") as file:
                parents[int(entry)] = int(file.read().rpartition(")")[2].split()[1])
        except (ValueError, OSError):
            continue
    found, frontier = set(), {os.getpid()}
    while frontier:
        frontier = {pid for pid, parent in parents.items() if parent in frontier} - found
        found |= frontier
    return found


@pytest.fixture(autouse=True)
def _no_stray_processes():
    before = _descendants()
    yield
    stray = [pid for pid in _descendants() - before if _alive(pid)]
    assert not stray, f"processes left running: {stray}"


def _exit_codes(runner):
    return [status.exit_code for status in runner.process_status().values()]


def _pids(runner):
    return [status.pid for status in runner.process_status().values()]


def _keras_dist_command():
    return os.path.join(os.path.dirname(sys.executable), "keras-dist")


_SCRIPT = textwrap.dedent(
    """
    import json, os, sys
    task = json.loads(os.environ["TF_CONFIG"])["task"]
    print(f"hello from {task['type']} {task['index']} args={sys.argv[1:]}", flush=True)
    if "--fail" in sys.argv and task == {"type": "worker", "index": 1}:
        sys.exit(3)
    if "--devices" in sys.argv:
        flags = os.environ.get("XLA_FLAGS", "")
        print(f"devices of {task['type']} {task['index']}: {flags.rpartition('=')[2]}", flush=True)
    if "--sleep" in sys.argv:
        print(f"ready pid={os.getpid()}", flush=True)
        import time
        time.sleep(600)
    """
)


@pytest.fixture
def script(tmp_path):
    path = tmp_path / "train.py"
    path.write_text(_SCRIPT)
    return str(path)


# Four workers; the others hold a connection to worker 2 and fail when it breaks, as the
# peers of a collective do: with keras_dist's error naming the lost task, or (--silent) a
# bare exit 1. Worker 2 kills itself with --die; without, the test kills it.
_LOSE_WORKER_2 = textwrap.dedent(
    """
    import json, os, signal, socket, sys, time

    class UnavailableError(RuntimeError):
        "keras_dist.errors.UnavailableError's name (importing keras_dist takes seconds)."

    config = json.loads(os.environ["TF_CONFIG"])
    host, port = config["cluster"]["worker"][2].rsplit(":", 1)
    if config["task"]["index"] == 2:
        server = socket.create_server((host, int(port)))
        peers = [server.accept()[0] for _ in range(3)]
        print(f"peers connected pid={os.getpid()}", flush=True)
        if "--die" in sys.argv:
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(600)
    deadline = time.monotonic() + 30
    while True:
        try:
            peer = socket.create_connection((host, int(port)))
            break
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)
    print(f"connected pid={os.getpid()}", flush=True)
    peer.recv(1)  # b"" once worker 2 is gone
    if "--silent" in sys.argv:
        sys.exit(1)
    raise UnavailableError("Lost contact with worker 2 during a collective: the task died.")
    """
)


@pytest.fixture
def lose_worker_2(tmp_path):
    path = tmp_path / "lose_worker_2.py"
    path.write_text(_LOSE_WORKER_2)
    return str(path)


# --- Cluster specs ---------------------------------------------------------------------------


def test_create_cluster_spec_has_every_job_on_localhost_with_distinct_ports():
    spec = testing.create_cluster_spec(has_chief=True, num_workers=3, num_ps=2, has_eval=True)
    assert list(spec) == ["chief", "worker", "ps", "evaluator"]
    assert [len(tasks) for tasks in spec.values()] == [1, 3, 2, 1]
    addresses = [address for tasks in spec.values() for address in tasks]
    assert all(address.startswith("127.0.0.1:") for address in addresses)
    assert len(set(addresses)) == 7
    assert list(testing.create_cluster_spec()) == ["worker"]
    ports = [testing.pick_unused_port() for _ in range(50)]
    assert len(set(ports)) == 50


# --- MultiProcessRunner ----------------------------------------------------------------------


def test_results_come_in_task_order_with_each_tasks_tf_config(monkeypatch):
    monkeypatch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=8 --xla_dump_to=x")
    cluster = testing.create_cluster_spec(has_chief=True, num_workers=2)
    with testing.MultiProcessRunner(
        _describe, cluster, args=(100,), kwargs={"scale": 10}, stream_output=False
    ) as runner:
        runner.start()
        results = runner.join(timeout=30)
    assert [r["tf_config"]["task"] for r in results] == [
        {"type": "chief", "index": 0},
        {"type": "worker", "index": 0},
        {"type": "worker", "index": 1},
    ]
    assert all(r["tf_config"]["cluster"] == cluster for r in results)
    assert [r["value"] for r in results] == [100, 100, 110]
    # The parent's simulated devices are not inherited; its other XLA flags are.
    assert results[0]["env"] == {
        "XLA_FLAGS": "--xla_dump_to=x",
        "KERAS_BACKEND": "jax",
        "PYTHONUNBUFFERED": "1",
    }
    status = runner.process_status()
    assert [s.state for s in status.values()] == ["succeeded"] * 3
    assert [runner.exit_code(*key) for key in status] == [0, 0, 0]


def test_devices_per_worker_sets_the_device_count_of_each_task():
    simulated = testing.MultiProcessRunner(
        _devices, testing.create_cluster_spec(num_workers=2), devices_per_worker=3
    )
    default = testing.MultiProcessRunner(_devices, testing.create_cluster_spec(num_workers=1))
    simulated.start()
    default.start()
    assert simulated.join(timeout=30) == [(3, "cpu"), (3, "cpu")]
    # One device by default, though this process simulates 8.
    assert default.join(timeout=30) == [(1, None)]
    # Or one count per task: machines with different devices.
    different = testing.MultiProcessRunner(
        _devices,
        testing.create_cluster_spec(has_chief=True, num_workers=2),
        devices_per_worker=[1, 2, 4],
    )
    different.start()
    assert different.join(timeout=30) == [(1, "cpu"), (2, "cpu"), (4, "cpu")]
    with pytest.raises(ValueError, match=r"one count per task \(2: worker 0, worker 1\)"):
        testing.MultiProcessRunner(
            _devices, testing.create_cluster_spec(num_workers=2), devices_per_worker=[1, 2, 4]
        )


def test_output_is_streamed_with_task_prefixes_and_kept_in_logs(capsys):
    cluster = testing.create_cluster_spec(num_workers=2)
    runner = testing.MultiProcessRunner(_print_lines, cluster)
    runner.start()
    assert runner.join(timeout=30) == [0, 1]
    out = capsys.readouterr().out.splitlines()
    for index in (0, 1):
        assert f"[worker {index}] stdout of {index}" in out
        assert f"[worker {index}] stderr of {index}" in out
    assert runner.logs("worker", 1).splitlines() == ["stdout of 1", "stderr of 1"]


def test_exception_is_reraised_with_its_type_task_and_every_tasks_log():
    with pytest.raises(_CustomError) as info:
        launch(
            _raise_on_worker_1,
            num_workers=2,
            has_chief=True,
            args=(_CustomError, "no luck"),
            stream_output=False,
            timeout=30,
        )
    error = info.value
    message = str(error)
    assert message.startswith("worker 1 raised _CustomError: no luck")
    assert "raise error_type(*error_args)" in message  # The task's traceback.
    for name in ("chief 0", "worker 0", "worker 1"):
        assert f"===== {name} (" in message
        assert f"{name} says hi" in message
    assert isinstance(error, testing.WorkerError)
    assert (error.task_type, error.task_id) == ("worker", 1)
    assert error.exit_codes == {("chief", 0): 0, ("worker", 0): 0, ("worker", 1): 1}
    assert error.results == [0, 0, None]
    assert "worker 0 says hi" in error.logs[("worker", 0)]


def test_exception_that_cannot_be_rebuilt_is_a_worker_error():
    with pytest.raises(testing.WorkerError, match="worker 1 raised _TwoArgumentError") as info:
        launch(
            _raise_on_worker_1,
            args=(_TwoArgumentError, "failed", "of a test"),
            stream_output=False,
            timeout=30,
        )
    assert type(info.value) is testing.WorkerError
    assert info.value.exception_type == "_TwoArgumentError"
    assert "failed because of a test" in str(info.value)
    assert "worker 0 says hi" in str(info.value)


def test_exit_without_result_is_an_unexpected_exit_naming_the_task():
    cluster = testing.create_cluster_spec(num_workers=2)
    runner = testing.MultiProcessRunner(_exit_3_on_worker_1, cluster, stream_output=False)
    runner.start()
    with pytest.raises(testing.UnexpectedSubprocessExitError) as info:
        runner.join(timeout=30)
    message = str(info.value)
    assert message.startswith("worker 1 exited unexpectedly (exit code 3) without a result")
    assert "worker 0 says hi" in message and "worker 1 says hi" in message
    assert (info.value.task_type, info.value.task_id) == ("worker", 1)
    assert info.value.exit_codes[("worker", 1)] == 3
    assert runner.process_status()[("worker", 1)].state == "failed"


def test_tasks_that_ignore_sigterm_are_killed_after_the_grace_period():
    cluster = testing.create_cluster_spec(num_workers=2)
    runner = testing.MultiProcessRunner(
        _ignore_sigterm_and_sleep, cluster, terminate_grace=1, stream_output=False
    )
    runner.start()
    _wait_for(lambda: all("ignoring" in runner.logs("worker", i) for i in (0, 1)), timeout=30)
    begin = time.monotonic()
    with pytest.raises(testing.SubprocessTimeoutError) as info:
        runner.join(timeout=0.5)
    assert time.monotonic() - begin < 0.5 + 1 + 3
    assert info.value.exit_codes == {("worker", 0): -9, ("worker", 1): -9}
    assert "join's timeout of 0.5 s" in str(info.value)
    assert "(terminated, killed by SIGKILL) =====\nignoring SIGTERM" in str(info.value)


def test_max_run_time_stops_every_task():
    cluster = testing.create_cluster_spec(num_workers=2)
    runner = testing.MultiProcessRunner(_sleep, cluster, max_run_time=1, stream_output=False)
    runner.start()
    with pytest.raises(testing.SubprocessTimeoutError, match="max_run_time of 1 s"):
        runner.join(timeout=30)
    assert all(code < 0 for code in _exit_codes(runner))


def test_workers_are_stopped_after_the_chief_exits():
    cluster = testing.create_cluster_spec(has_chief=True, num_workers=1)
    runner = testing.MultiProcessRunner(
        _chief_returns_worker_sleeps, cluster, failure_grace=0.2, stream_output=False
    )
    runner.start()
    assert runner.join(timeout=30) == ["chief done", None]
    assert runner.process_status()[("worker", 0)].state == "terminated"


def test_without_dependence_on_chief_workers_finish(tmp_path):
    cluster = testing.create_cluster_spec(has_chief=True, num_workers=1)
    runner = testing.MultiProcessRunner(
        _chief_marks_worker_waits,
        cluster,
        args=(str(tmp_path / "chief_done"),),
        dependence_on_chief=False,
        failure_grace=0,
        stream_output=False,
    )
    runner.start()
    assert runner.join(timeout=30) == ["chief done", "worker done"]


def _chief_waits_for_marker_workers_wait(marker):
    # The chief ends once the test says so; the workers and the ps serve until stopped.
    _wait_for(lambda: os.path.exists(marker), timeout=60)
    if _task()["type"] == "chief":
        return "chief done"
    time.sleep(600)


def test_a_survivable_worker_fails_and_the_job_goes_on(tmp_path):
    # A parameter-server job: the coordinator gives a lost worker's work to the others.
    # Before, the runner stopped every task failure_grace after any worker died.
    cluster = testing.create_cluster_spec(has_chief=True, num_workers=2, num_ps=1)
    marker = tmp_path / "chief may end"
    runner = testing.MultiProcessRunner(
        _chief_waits_for_marker_workers_wait,
        cluster,
        args=(str(marker),),
        survivable=("worker",),
        failure_grace=0.5,
        stream_output=False,
    )
    runner.start()
    _wait_for(lambda: runner.process_status()[("worker", 1)].pid, timeout=30)
    time.sleep(1)
    os.kill(runner.process_status()[("worker", 1)].pid, signal.SIGKILL)  # the OOM killer
    _wait_for(lambda: runner.process_status()[("worker", 1)].state == "lost", timeout=30)
    time.sleep(2)  # four times the grace: nothing else is stopped
    states = {key: status.state for key, status in runner.process_status().items()}
    assert states == {
        ("chief", 0): "running",
        ("worker", 0): "running",
        ("worker", 1): "lost",
        ("ps", 0): "running",
    }
    # The last worker is not survivable: losing it stops the job, and join says so.
    os.kill(runner.process_status()[("worker", 0)].pid, signal.SIGKILL)
    with pytest.raises(testing.UnexpectedSubprocessExitError) as raised:
        runner.join(timeout=60)
    assert (raised.value.task_type, raised.value.task_id) == ("worker", 0)
    runner.close()


def test_auto_restart_relaunches_a_failed_task_with_the_same_tf_config(tmp_path):
    cluster = testing.create_cluster_spec(num_workers=2)
    runner = testing.MultiProcessRunner(
        _fail_first_run_of_worker_1,
        cluster,
        args=(str(tmp_path), "exit"),
        auto_restart=True,
        max_restarts=1,
        stream_output=False,
    )
    runner.start()
    results = runner.join(timeout=30)
    first_run = json.loads((tmp_path / "worker-1").read_text())
    assert results[1] == first_run
    assert [s.restarts for s in runner.process_status().values()] == [0, 1]
    assert "worker 1 restarted (restart 1)" in runner.logs("worker", 1)


def test_auto_restart_gives_up_after_max_restarts():
    cluster = testing.create_cluster_spec(num_workers=1)
    runner = testing.MultiProcessRunner(
        _always_exit_7, cluster, auto_restart=True, max_restarts=2, stream_output=False
    )
    runner.start()
    with pytest.raises(testing.UnexpectedSubprocessExitError, match="exit code 7"):
        runner.join(timeout=30)
    assert runner.process_status()[("worker", 0)].restarts == 2


def test_terminate_kill_and_start_single_process():
    cluster = testing.create_cluster_spec(num_workers=2)
    runner = testing.MultiProcessRunner(_sleep, cluster, stream_output=False)
    runner.start()
    _wait_for(lambda: all("sleeping" in runner.logs("worker", i) for i in (0, 1)), timeout=30)
    runner.kill("worker", 1)
    runner.terminate("worker", 0, grace=5)
    assert _exit_codes(runner) == [-signal.SIGTERM, -signal.SIGKILL]
    assert [s.state for s in runner.process_status().values()] == ["terminated"] * 2

    runner.start_single_process("worker", 1)
    assert runner.process_status()[("worker", 1)].state == "running"
    with pytest.raises(ValueError, match="running already"):
        runner.start_single_process("worker", 1)
    runner.terminate_all()
    assert runner.join(timeout=30) == [None, None]
    with pytest.raises(ValueError, match="no task chief 0"):
        runner.terminate("chief", 0)


def test_no_task_outlives_its_runner():
    cluster = testing.create_cluster_spec(num_workers=2)
    with testing.MultiProcessRunner(
        _ignore_sigterm_and_sleep, cluster, terminate_grace=0.5, stream_output=False
    ) as runner:
        runner.start()
        pids = _pids(runner)
    assert not any(_alive(pid) for pid in pids)

    abandoned = testing.MultiProcessRunner(_sleep, cluster, stream_output=False)
    abandoned.start()
    pids = _pids(abandoned)
    del abandoned
    gc.collect()
    _wait_for(lambda: not any(_alive(pid) for pid in pids), timeout=10)


# --- launch ----------------------------------------------------------------------------------


def test_launch_restarts_the_whole_cluster_on_new_ports(tmp_path, capsys):
    results = launch(
        _fail_first_run_of_worker_1,
        num_workers=2,
        args=(str(tmp_path), "raise"),
        max_restarts=1,
        failure_grace=5,
        timeout=30,
    )
    first_cluster = json.loads((tmp_path / "worker-1").read_text())["cluster"]
    assert results[0]["cluster"] == results[1]["cluster"] != first_cluster
    assert [r["task"]["index"] for r in results] == [0, 1]
    assert (
        "[keras-dist] worker 1 raised RuntimeError: first run fails; restarting every task on "
        "new ports (restart 1 of 1)." in capsys.readouterr().out
    )


def test_launch_without_restarts_raises_the_first_failure(tmp_path):
    with pytest.raises(RuntimeError, match="worker 1 raised RuntimeError: first run fails"):
        launch(
            _fail_first_run_of_worker_1,
            args=(str(tmp_path), "raise"),
            stream_output=False,
            timeout=30,
        )


def test_launch_timeout_stops_every_task():
    with pytest.raises(testing.SubprocessTimeoutError) as info:
        launch(_sleep, num_workers=2, timeout=1, stream_output=False)
    assert all(code < 0 for code in info.value.exit_codes.values())


def test_launch_from_a_script_and_its_tasks_die_with_it(tmp_path):
    path = tmp_path / "driver.py"
    path.write_text(
        textwrap.dedent(
            """
            import json, os, time
            from keras_dist._launch import launch, MultiProcessRunner, create_cluster_spec

            def offset_index(offset):
                return offset + json.loads(os.environ["TF_CONFIG"])["task"]["index"]

            def report_pid_and_sleep():
                print(f"pid={os.getpid()}", flush=True)
                time.sleep(600)

            if __name__ == "__main__":
                print("results", launch(offset_index, num_workers=2, args=(10,), timeout=30))
                cluster = create_cluster_spec(num_workers=2)
                runner = MultiProcessRunner(report_pid_and_sleep, cluster)
                runner.start()
                runner.join()
            """
        )
    )
    driver = subprocess.Popen(
        [sys.executable, str(path)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    try:
        lines, pids = [], []
        while len(pids) < 2:
            lines.append(driver.stdout.readline())
            assert lines[-1], "".join(lines)
            if "pid=" in lines[-1]:
                pids.append(int(lines[-1].rpartition("=")[2]))
        # Functions of the script's __main__ reached the tasks.
        assert "results [10, 11]\n" in lines
        # A launcher killed outright takes its tasks with it.
        driver.kill()
        _wait_for(lambda: not any(_alive(pid) for pid in pids), timeout=10)
    finally:
        driver.kill()
        driver.wait()


# --- The keras-dist command ------------------------------------------------------------------


def test_cli_runs_the_script_per_task_with_prefixed_output(script):
    done = subprocess.run(
        [_keras_dist_command(), "launch", "--workers", "2", script, "--flag"],
        capture_output=True,
        text=True,
        timeout=50,
    )
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert "[worker 0] hello from worker 0 args=['--flag']" in lines
    assert "[worker 1] hello from worker 1 args=['--flag']" in lines


def test_cli_exits_with_the_code_of_the_failed_task(script, capsys):
    # In this process (the command's own start-up, importing Keras, is tested above).
    assert cli_main(["launch", "--chief", "--grace", "5", script, "--fail"]) == 3
    captured = capsys.readouterr()
    assert "[chief 0] hello from chief 0 args=['--fail']" in captured.out.splitlines()
    assert "keras-dist: worker 1 failed (exit code 3)." in captured.err


@pytest.mark.parametrize("victims", ["--silent", "--reporting"])
def test_cli_blames_the_worker_that_died_not_the_peers_that_failed_after_it(
    lose_worker_2, capsys, victims
):
    # Worker 2 is SIGKILLed; workers 0, 1 and 3 exit 1 a few milliseconds later, usually
    # before the launcher's next look at its tasks.
    code = cli_main(["launch", "--workers", "4", "--grace", "5", lose_worker_2, "--die", victims])
    captured = capsys.readouterr()
    logs = captured.out + captured.err
    assert code == 128 + signal.SIGKILL, logs
    assert "keras-dist: worker 2 failed (killed by SIGKILL)." in captured.err, logs
    assert logs.count("connected pid=") == 4, logs


@pytest.mark.timeout(120)
@pytest.mark.parametrize("victims", ["--silent", "--reporting"])
def test_cli_blames_the_worker_that_died_when_it_finds_every_exit_at_once(lose_worker_2, victims):
    # The launcher is stopped (a loaded machine) while worker 2 is killed and the others
    # fail: when it runs again every exit is there at once, and it still names worker 2.
    cli = subprocess.Popen(
        [sys.executable, "-m", "keras_dist._launch._cli", "launch", "--workers", "4"]
        + ["--grace", "5", lose_worker_2, victims],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    lines = []
    try:
        pids = {}
        while len(pids) < 4:
            lines.append(cli.stdout.readline())
            assert lines[-1], "".join(lines) + cli.stderr.read()
            if "connected pid=" in lines[-1]:
                pids[lines[-1].split("]")[0]] = int(lines[-1].rpartition("=")[2])
        cli.send_signal(signal.SIGSTOP)
        try:
            os.kill(pids["[worker 2"], signal.SIGKILL)
            # Every worker exited (its zombie waits for the stopped launcher).
            _wait_for(lambda: not any(_alive(pid) for pid in pids.values()), timeout=20)
        finally:
            cli.send_signal(signal.SIGCONT)
        out, err = cli.communicate(timeout=60)
        logs = "".join(lines) + out + err
        assert cli.returncode == 128 + signal.SIGKILL, logs
        assert "keras-dist: worker 2 failed (killed by SIGKILL)." in err, logs
    finally:
        cli.kill()
        cli.wait()


def test_cli_gives_each_task_its_own_device_count(script, capsys):
    assert cli_main(["launch", "--devices-per-worker", "2,4", script, "--devices"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert "[worker 0] devices of worker 0: 2" in out
    assert "[worker 1] devices of worker 1: 4" in out


def test_cli_forwards_sigterm_to_the_tasks(script):
    cli = subprocess.Popen(
        [sys.executable, "-m", "keras_dist._launch._cli", "launch", "--workers", "2"]
        + [script, "--sleep"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        pids = []
        while len(pids) < 2:
            line = cli.stdout.readline()
            assert line, cli.stderr.read()
            if "ready pid=" in line:
                pids.append(int(line.rpartition("=")[2]))
        cli.send_signal(signal.SIGTERM)
        assert cli.wait(timeout=20) == 128 + signal.SIGTERM
        assert "stopping every task" in cli.stderr.read()
        assert not any(_alive(pid) for pid in pids)
    finally:
        cli.kill()
        cli.wait()


def test_cli_leaves_a_signal_ignored_on_purpose_ignored(script):
    # As under `nohup`: the command inherits SIGHUP ignored, and keeps it so.
    previous = signal.signal(signal.SIGHUP, signal.SIG_IGN)
    try:
        cli = subprocess.Popen(
            [sys.executable, "-m", "keras_dist._launch._cli", "launch", "--workers", "1"]
            + [script, "--sleep"],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
    finally:
        signal.signal(signal.SIGHUP, previous)
    try:
        line = cli.stdout.readline()
        while line and "ready pid=" not in line:
            line = cli.stdout.readline()
        assert line, cli.stderr.read()
        pid = int(line.rpartition("=")[2])
        # Python runs pending handlers in signal-number order: a SIGHUP that was handled
        # would decide the exit code before the SIGTERM sent after it.
        cli.send_signal(signal.SIGHUP)
        cli.send_signal(signal.SIGTERM)
        assert cli.wait(timeout=20) == 128 + signal.SIGTERM, cli.stderr.read()
        assert not _alive(pid)
    finally:
        cli.kill()
        cli.wait()


def test_cli_in_process_timeout_help_and_errors(script, capsys):
    assert cli_main(["launch", "--workers", "1", "--timeout", "1", script, "--sleep"]) == 124
    assert "did not finish within --timeout 1 s" in capsys.readouterr().err
    with pytest.raises(SystemExit) as info:
        cli_main(["launch", "--help"])
    assert info.value.code == 0
    assert "--devices-per-worker" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        cli_main(["launch", "missing.py"])
    assert "no such script" in capsys.readouterr().err
    assert cli_main([]) == 2


@pytest.mark.parametrize(
    "arguments, said",
    [
        (["--workers", "abc"], "--workers: must be a whole number, got 'abc'"),
        (["--workers", "2", "--devices-per-worker", "2,2,2"], "one count per task"),
        (["--workers", "1", "--log-dir", "/proc/no-such-dir"], "/proc/no-such-dir"),
    ],
)
def test_cli_options_that_do_not_fit_are_argparse_errors_not_tracebacks(
    script, capsys, arguments, said
):
    with pytest.raises(SystemExit) as info:
        cli_main(["launch", *arguments, script])
    assert info.value.code == 2
    error = capsys.readouterr().err
    assert "keras-dist launch: error:" in error and said in error
    assert "Traceback" not in error
