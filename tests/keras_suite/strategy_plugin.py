"""A pytest plugin that runs every test of Keras's own suite inside a strategy's scope.

``KERAS_DIST_SUITE_STRATEGY`` names the strategy: ``plain`` (no strategy, the baseline),
``mirrored`` (``MirroredStrategy()`` over 4 simulated CPU devices), ``one_device``
(``OneDeviceStrategy("/cpu:0")``), ``multi_worker_mirrored`` (this process is one worker of
the cluster in ``TF_CONFIG``, 2 simulated devices each; ``multi_worker.py`` starts the
workers) or ``parameter_server`` (``ParameterServerStrategy`` over an in-process cluster of
2 workers and 2 ps tasks, made once per pytest process). The scope is entered around the
whole test, ``setUp`` and ``tearDown`` included, as a notebook user's scope is around
everything they run: Keras's ``TestCase.setUp`` calls ``keras.backend.clear_session()``
inside it. Leaving the scope after the test is part of the test: an error there fails it.

Loaded with ``-p strategy_plugin`` (this folder on ``PYTHONPATH``) before JAX starts.
"""

import json
import os
import random
import zlib

# Each worker of the multi-worker pass has 2 devices: 4 replicas in all, as the others.
_DEVICES = 2 if os.environ.get("KERAS_DIST_SUITE_STRATEGY") == "multi_worker_mirrored" else 4
os.environ["KERAS_BACKEND"] = "jax"
# As Keras's own test setup: jax.experimental.enable_x64 keeps 32-bit defaults.
os.environ["JAX_DEFAULT_DTYPE_BITS"] = "32"
os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={_DEVICES}"
).strip()

import numpy as np  # noqa: E402
import pytest  # noqa: E402

STRATEGIES = ("plain", "mirrored", "one_device", "multi_worker_mirrored", "parameter_server")

# How long one multi-worker execution may wait for the other worker (a collective the other
# never joins fails the test instead of hanging), and how far apart the workers may start
# a test (the slower one still running the test before).
COLLECTIVE_TIMEOUT_S = 60
TEST_START_TIMEOUT_S = 300

# The strategy of this pytest process, made once for these: a multi-worker runtime starts
# once per process, and an in-process parameter-server cluster lives as long as the process.
_SHARED = ("multi_worker_mirrored", "parameter_server")
_strategy = None
# Set when a test failed because the other worker is gone: this process cannot run a
# collective again, so it ends once the test's outcome is recorded.
_cluster_lost = False
_tests_started = 0


def _strategy_name() -> str:
    name = os.environ.get("KERAS_DIST_SUITE_STRATEGY", "plain")
    if name not in STRATEGIES:
        raise ValueError(
            f"KERAS_DIST_SUITE_STRATEGY must be one of {STRATEGIES}. Received: {name!r}"
        )
    return name


def _make_strategy(name):
    import keras_dist as kd

    if name == "mirrored":
        return kd.MirroredStrategy()
    if name == "one_device":
        return kd.OneDeviceStrategy("/cpu:0")
    if name == "multi_worker_mirrored":
        options = kd.experimental.CommunicationOptions(timeout_seconds=COLLECTIVE_TIMEOUT_S)
        return kd.MultiWorkerMirroredStrategy(communication_options=options)
    # One worker runs the steps one after another (plain Keras's numbers); two, at once.
    workers = int(os.environ.get("KERAS_DIST_SUITE_PS_WORKERS", "2"))
    cluster = kd.testing.create_in_process_cluster(num_workers=workers, num_ps=2)
    return kd.ParameterServerStrategy(cluster)


def _shared_strategy(name):
    global _strategy
    if _strategy is None:
        _strategy = _make_strategy(name)
    return _strategy


def pytest_configure(config):
    name = _strategy_name()
    if name != "plain":
        import keras_dist  # noqa: F401  (its Keras hooks are in place before any test)
    if name == "multi_worker_mirrored":
        _shared_strategy(name)  # JAX's multi-process runtime starts before anything uses JAX


def pytest_report_header(config):
    return f"keras_dist suite: every test inside {_strategy_name()!r}"


def pytest_collection_modifyitems(config, items):
    # A multi-worker pass restarted after a lost worker goes on after the tests done.
    done_file = os.environ.get("KERAS_DIST_SUITE_DONE")
    if not done_file:
        return
    with open(done_file) as f:
        done = set(json.load(f))
    kept = [item for item in items if item.nodeid not in done]
    config.hook.pytest_deselected(items=[item for item in items if item.nodeid in done])
    items[:] = kept


def pytest_collection_finish(session):
    _progress({"collected": [item.nodeid for item in session.items]})


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item, nextitem):
    if _strategy_name() == "multi_worker_mirrored":
        _start_together(item.nodeid)
    return (yield)


def _start_together(nodeid):
    """Both workers start each test together, and the same test (or the process ends).

    Every test must do the same collectives on both workers in the same order; a worker
    that does not reach this test in time is lost (hung, crashed, or ran another test).
    The barrier is the coordination service's (JAX's distributed client), not a collective,
    so it cannot be paired with a collective that the other worker is still waiting in.
    """
    from jax._src import distributed

    global _tests_started
    _tests_started += 1
    barrier = f"keras_suite/{_tests_started}/{zlib.crc32(nodeid.encode()):08x}"
    try:
        distributed.global_state.client.wait_at_barrier(barrier, TEST_START_TIMEOUT_S * 1000)
    except Exception as error:  # noqa: BLE001  (the other worker is lost, whatever JAX says)
        print(f"\nkeras_suite: the other worker did not start {nodeid}: {error}", flush=True)
        os._exit(3)
    _progress({"started": nodeid})
    # The same program on every worker, as `keras-dist launch` runs it: Keras's tests draw
    # their data from unseeded NumPy and Python generators.
    seed = zlib.crc32(nodeid.encode())
    random.seed(seed)
    np.random.seed(seed)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item):
    name = _strategy_name()
    if name == "plain":
        return (yield)
    import keras_dist as kd

    strategy = _shared_strategy(name) if name in _SHARED else _make_strategy(name)
    with strategy.scope():
        result = yield
    # Whatever the test did to Keras's global state, nothing of the strategy is left behind.
    if kd.has_strategy():
        raise AssertionError(f"A strategy is still in effect after its scope: {kd.get_strategy()}")
    return result


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    global _cluster_lost
    report = yield
    if call.excinfo is not None and _strategy_name() == "multi_worker_mirrored":
        from keras_dist import errors

        error = call.excinfo.value
        while error is not None:
            if isinstance(error, (errors.DeadlineExceededError, errors.UnavailableError)):
                _cluster_lost = True
            error = error.__cause__ or error.__context__
    return report


# Outcomes by test id, written as JSON to KERAS_DIST_SUITE_REPORT at the end of the session:
# "passed", "failed" (any phase failed) or "skipped".
_outcomes = {}


def pytest_runtest_logreport(report):
    if report.failed:
        _outcomes[report.nodeid] = "failed"
        if _strategy_name() == "multi_worker_mirrored":
            # Now: the process may end before pytest's summary (a lost worker).
            print(f"\n_____ {report.nodeid} ({report.when}) _____\n{report.longreprtext}")
    elif report.skipped and report.nodeid not in _outcomes:
        _outcomes[report.nodeid] = "skipped"
    elif report.when == "call" and report.passed:
        _outcomes.setdefault(report.nodeid, "passed")


def pytest_runtest_logfinish(nodeid, location):
    _progress({"test": nodeid, "outcome": _outcomes.get(nodeid, "failed")})
    if _cluster_lost:
        print(f"\nkeras_suite: the other worker was lost in {nodeid}; ending", flush=True)
        os._exit(3)


def pytest_collectreport(report):
    # A test module that cannot even be imported counts as one failed test.
    if report.failed:
        _outcomes[report.nodeid] = "failed"
        _progress({"test": report.nodeid, "outcome": "failed"})


def _progress(record):
    """Appends one line to ``KERAS_DIST_SUITE_PROGRESS``: what a killed process got to."""
    path = os.environ.get("KERAS_DIST_SUITE_PROGRESS")
    if path:
        with open(path, "a") as f:
            f.write(json.dumps(record) + "\n")


def pytest_sessionfinish(session):
    path = os.environ.get("KERAS_DIST_SUITE_REPORT")
    # Under pytest-xdist each worker's reports reach the controller, which writes them all.
    if path and not hasattr(session.config, "workerinput"):
        with open(path, "w") as f:
            json.dump(_outcomes, f, indent=0, sort_keys=True)
