"""A pytest plugin that runs every test of Keras's own suite inside a strategy's scope.

``KERAS_DIST_SUITE_STRATEGY`` names the strategy: ``plain`` (no strategy, the baseline),
``mirrored`` (``MirroredStrategy()`` over 4 simulated CPU devices) or ``one_device``
(``OneDeviceStrategy("/cpu:0")``). The scope is entered around the whole test, ``setUp``
and ``tearDown`` included, as a notebook user's scope is around everything they run: Keras's
``TestCase.setUp`` calls ``keras.backend.clear_session()`` inside it. Leaving the scope
after the test is part of the test: an error there fails it.

Loaded with ``-p strategy_plugin`` (this folder on ``PYTHONPATH``) before JAX starts.
"""

import os

os.environ["KERAS_BACKEND"] = "jax"
# As Keras's own test setup: jax.experimental.enable_x64 keeps 32-bit defaults.
os.environ["JAX_DEFAULT_DTYPE_BITS"] = "32"
os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4"
).strip()

import pytest  # noqa: E402

STRATEGIES = ("plain", "mirrored", "one_device")


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
    return kd.OneDeviceStrategy("/cpu:0")


def pytest_configure(config):
    if _strategy_name() != "plain":
        import keras_dist  # noqa: F401  (its Keras hooks are in place before any test)


def pytest_report_header(config):
    return f"keras_dist suite: every test inside {_strategy_name()!r}"


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item):
    name = _strategy_name()
    if name == "plain":
        return (yield)
    import keras_dist as kd

    with _make_strategy(name).scope():
        result = yield
    # Whatever the test did to Keras's global state, nothing of the strategy is left behind.
    if kd.has_strategy():
        raise AssertionError(f"A strategy is still in effect after its scope: {kd.get_strategy()}")
    return result


# Outcomes by test id, written as JSON to KERAS_DIST_SUITE_REPORT at the end of the session:
# "passed", "failed" (any phase failed) or "skipped".
_outcomes = {}


def pytest_runtest_logreport(report):
    if report.failed:
        _outcomes[report.nodeid] = "failed"
    elif report.skipped and report.nodeid not in _outcomes:
        _outcomes[report.nodeid] = "skipped"
    elif report.when == "call" and report.passed:
        _outcomes.setdefault(report.nodeid, "passed")


def pytest_collectreport(report):
    # A test module that cannot even be imported counts as one failed test.
    if report.failed:
        _outcomes[report.nodeid] = "failed"


def pytest_sessionfinish(session):
    path = os.environ.get("KERAS_DIST_SUITE_REPORT")
    # Under pytest-xdist each worker's reports reach the controller, which writes them all.
    if path and not hasattr(session.config, "workerinput"):
        import json

        with open(path, "w") as f:
            json.dump(_outcomes, f, indent=0, sort_keys=True)
