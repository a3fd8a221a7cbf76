"""A script written for GPUs runs on a CPU-only host, as TF's soft device placement runs it.

TF 2.21 on a host without GPUs: ``MirroredStrategy(["/gpu:0", "/gpu:1"])`` has 2
replicas on the CPU and ``reduce("SUM", run(lambda: v * 2))`` of ``v = 1.0`` is 4.0.
Here each GPU named goes to the CPU device of its index (simulated CPU devices),
with a warning; one beyond them says how to get more.
"""

import jax
import keras
import numpy as np
import pytest
from conftest import cpus

import keras_dist as kd


def _has(platform) -> bool:
    try:
        return bool(jax.local_devices(backend=platform))
    except RuntimeError:
        return False


pytestmark = pytest.mark.skipif(_has("gpu"), reason="this host has GPUs: '/gpu:0' is one")


def test_gpus_named_on_a_cpu_host_run_on_its_cpu_devices_with_tfs_numbers():
    with pytest.warns(UserWarning, match="'/gpu:1' names a GPU, and this host has none"):
        strategy = kd.MirroredStrategy(["/gpu:0", "/gpu:1"])
    assert strategy.num_replicas_in_sync == 2
    assert strategy.extended.worker_devices == kd.MirroredStrategy(cpus(2)).extended.worker_devices
    with strategy.scope():
        v = keras.Variable(1.0)
    assert float(strategy.reduce("SUM", strategy.run(lambda: v * 2), axis=None)) == 4.0


def test_fit_of_a_gpu_script_on_a_cpu_host_equals_the_cpu_devices():
    x = np.random.default_rng(0).normal(size=(32, 4)).astype("float32")
    y = x @ np.arange(4, dtype="float32")[:, None]

    def trained(devices):
        strategy = kd.MirroredStrategy(devices)
        with strategy.scope():
            keras.utils.set_random_seed(1)
            model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
            model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
        model.fit(x, y, batch_size=8, epochs=2, verbose=0)
        return model.get_weights()

    with pytest.warns(UserWarning, match="names a GPU"):
        on_gpus = trained(["GPU:0", "GPU:1"])
    for mine, cpu in zip(on_gpus, trained(cpus(2))):
        np.testing.assert_allclose(mine, cpu, rtol=0, atol=0)


def test_one_device_strategy_on_a_named_gpu_runs_on_the_cpu():
    with pytest.warns(UserWarning, match="names a GPU"):
        strategy = kd.OneDeviceStrategy("/device:GPU:0")
    on_cpu = kd.OneDeviceStrategy("/cpu:0")
    assert strategy.extended.worker_devices == on_cpu.extended.worker_devices


def test_more_gpus_than_cpu_devices_says_how_to_simulate_them():
    count = len(jax.local_devices(backend="cpu"))
    with pytest.raises(ValueError, match=f"device_count={count + 1} before JAX starts") as raised:
        kd.MirroredStrategy([f"/gpu:{i}" for i in range(count + 1)])
    assert f"Received: devices[{count}]='/gpu:{count}'" in str(raised.value)
