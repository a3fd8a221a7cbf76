"""Test setup: 8 simulated CPU devices, set before JAX starts."""

import os

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
