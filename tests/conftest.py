"""Test setup: 8 simulated CPU devices, set before JAX starts."""

import os
import pathlib
import signal
import subprocess
import sys
import tempfile

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()
os.environ.setdefault("KERAS_BACKEND", "jax")

import jax  # noqa: E402
import pytest  # noqa: E402

import keras_dist as kd  # noqa: E402


@pytest.fixture(params=["compiled", "eager"])
def engine(request):
    """Runs a test through both engines of ``strategy.run``."""
    kd.config.run_functions_eagerly(request.param == "eager")
    yield request.param
    kd.config.run_functions_eagerly(False)


@pytest.fixture(autouse=True)
def _reset_state():
    yield
    kd.config.run_functions_eagerly(False)
    kd.experimental_set_strategy(None)


def cpus(n):
    """The first ``n`` simulated CPU devices as TF device strings."""
    assert len(jax.devices("cpu")) >= n
    return [f"/cpu:{i}" for i in range(n)]


def tpu_strategy(num_replicas, cores_per_replica):
    """A ``TPUStrategy`` on the simulated TPU system: replicas of ``cores_per_replica`` cores."""
    resolver = kd.cluster_resolver.TPUClusterResolver(tpu="simulated")
    topology = kd.tpu.experimental.initialize_tpu_system(resolver)
    assignment = kd.tpu.experimental.DeviceAssignment.build(
        topology, computation_shape=[cores_per_replica, 1, 1, 1], num_replicas=num_replicas
    )
    return kd.TPUStrategy(resolver, experimental_device_assignment=assignment)


# --- The Keras-suite pass (tests/keras_integration/test_keras_suite.py) -----------------------
# Keras's own tests run in pytest processes of their own (tests/keras_suite/run.py), and most
# of this suite's first part keeps one CPU busy: started when the session's tests are
# collected, the Keras pass uses the other CPU meanwhile, and its test waits for the result.
RUNNER = pathlib.Path(__file__).resolve().parent / "keras_suite" / "run.py"
MIRRORED_PASS = [sys.executable, str(RUNNER), "--folders", "trainers", "callbacks"]
MIRRORED_PASS += ["--strategies", "mirrored"]
_SUITE_TEST = "test_keras_trainer_and_callback_tests_pass_under_mirrored_strategy"


class BackgroundRun:
    """A command started now, its output in a temporary file until ``result``.

    The command runs in a process group of its own, killed whole: the runner's
    own pytest processes must not outlive a session that stopped it.
    """

    def __init__(self, command):
        self._log = tempfile.TemporaryFile(mode="w+")
        self._process = subprocess.Popen(
            command, stdout=self._log, stderr=subprocess.STDOUT, text=True, start_new_session=True
        )
        self._group_killed = False

    def result(self, timeout: float) -> tuple[int, str]:
        """``(exit status, output)``; killed, with what it printed, past ``timeout`` seconds."""
        try:
            code = self._process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self._kill_group()
            code = self._process.wait()
        self._kill_group()  # whatever the runner left behind
        self._log.seek(0)
        return code, self._log.read()

    def stop(self) -> None:
        self._kill_group()
        self._process.wait()
        self._log.close()

    def _kill_group(self) -> None:
        # Once is enough (SIGKILL reaches the whole group), and later the runner,
        # reaped, may have left its process id to another process.
        if self._group_killed:
            return
        self._group_killed = True
        try:
            os.killpg(self._process.pid, signal.SIGKILL)
        except ProcessLookupError:  # the runner and all it started have exited
            pass


_RUNS: dict = {}


def pytest_collection_modifyitems(items):
    # With ``-n 2 --dist loadgroup`` (the README's test command) the tests that start a
    # cluster of processes run one after another on one pytest worker, as they would
    # alone: two clusters at once on a 2-core machine would starve each other's
    # heartbeats and deadlines. The other worker runs the rest meanwhile.
    for item in items:
        if item.get_closest_marker("multiprocess"):
            item.add_marker(pytest.mark.xdist_group("processes"))


def pytest_collection_finish(session):
    # Under pytest-xdist every worker collects every test and only one runs it:
    # there the pass starts when its test asks for it (the fixture below).
    if os.environ.get("PYTEST_XDIST_WORKER"):
        return
    if any(item.name == _SUITE_TEST for item in session.items):
        _RUNS[_SUITE_TEST] = BackgroundRun(MIRRORED_PASS)


def pytest_sessionfinish(session):
    for run in _RUNS.values():
        run.stop()


@pytest.fixture
def keras_suite_mirrored_pass() -> BackgroundRun:
    """The Mirrored pass started at collection (or now, when collected some other way)."""
    return _RUNS.setdefault(_SUITE_TEST, BackgroundRun(MIRRORED_PASS))
