"""Test setup: 8 simulated CPU devices, set before JAX starts."""

import os

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()
os.environ.setdefault("KERAS_BACKEND", "jax")

import jax  # noqa: E402
import pytest  # noqa: E402

import keras_dist as kd  # noqa: E402


# Tests that start processes, kill them on a timer, or measure memory run one at a time
# on one pytest-xdist worker (`-n auto --dist loadgroup`, the README's test command), as
# they would alone; the rest spread over the other workers.
_ONE_AT_A_TIME = pytest.mark.xdist_group("processes")


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist reads the groups
def pytest_collection_modifyitems(config, items):
    for item in items:
        folder = item.path.relative_to(config.rootpath).parts[1]
        if (
            item.get_closest_marker("multiprocess")
            or folder == "train"
            or item.path.name == "test_resources.py"
        ):
            item.add_marker(_ONE_AT_A_TIME)


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
