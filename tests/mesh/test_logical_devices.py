"""Logical devices: replicas that span several devices (model parallelism inside a replica).

A 2x2 device assignment on 4 simulated cores gives 2 replicas of 2 logical
devices. The split/replicate/assign calls must give the unsplit numbers, and
the compiled program must really partition (the lowered program carries the
sharding, and each device computes on its piece). No TPU or GPU is available
where these run; the same code runs on them.
"""

import pathlib
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import keras
import numpy as np
import pytest

import keras_dist as kd

TPU = kd.tpu.experimental
ROOT = pathlib.Path(__file__).resolve().parents[2]
W = np.arange(24, dtype="float32").reshape(3, 8) / 10.0
X = np.arange(30, dtype="float32").reshape(10, 3) / 7.0


def _assignment(num_replicas=2, cores_per_replica=2):
    topology = TPU.Topology.from_devices(jax.devices("cpu")[: num_replicas * cores_per_replica])
    return TPU.DeviceAssignment.build(
        topology, computation_shape=[cores_per_replica, 1, 1, 1], num_replicas=num_replicas
    )


def _tpu_strategy(num_replicas=2, cores_per_replica=2, spmd=False):
    resolver = kd.cluster_resolver.TPUClusterResolver(tpu="simulated")
    return kd.TPUStrategy(
        resolver,
        experimental_device_assignment=_assignment(num_replicas, cores_per_replica),
        experimental_spmd_xla_partitioning=spmd,
    )


def _strategies():
    return {
        "tpu": _tpu_strategy(),
        "mirrored": kd.MirroredStrategy(experimental_device_assignment=_assignment()),
    }


def _rows(strategy, per_replica):
    return np.concatenate([np.asarray(v) for v in strategy.experimental_local_results(per_replica)])


def _entry(strategy):
    # Tests read the engine's cache to inspect the program it compiled.
    return list(strategy.extended._compiled._cache.values())[-1]


@pytest.mark.parametrize("kind", ["tpu", "mirrored"])
def test_2x2_assignment_gives_2_replicas_and_the_unsplit_numbers(kind, engine):
    strategy = _strategies()[kind]
    assert strategy.num_replicas_in_sync == 2
    assert strategy.extended.placement.mesh.devices.shape == (2, 2)
    ids = strategy.run(lambda: kd.get_replica_context().replica_id_in_sync_group)
    assert int(strategy.reduce("SUM", ids, axis=None)) == 1
    (batch,) = list(strategy.experimental_distribute_dataset([X]))

    def step(x):
        x = strategy.experimental_split_to_logical_devices(x, [1, 1])  # 1 x 1 != 2 cores
        return x

    with pytest.raises(ValueError, match=r"product of `partition_dimensions`.*\(=2\)"):
        strategy.run(step, args=(batch,))

    def model(x):
        w = strategy.experimental_split_to_logical_devices(jnp.asarray(W), [1, 2])
        hidden = strategy.experimental_split_to_logical_devices(jnp.tanh(x @ w), [1, 2])
        whole = strategy.experimental_replicate_to_logical_devices(hidden)
        one = strategy.experimental_assign_to_logical_device(whole * 2.0, 1)
        return keras.ops.sum(one, axis=1), one

    sums, outputs = strategy.run(model, args=(batch,))
    expected = 2.0 * np.tanh(X @ W)
    np.testing.assert_allclose(_rows(strategy, outputs), expected, rtol=1e-6)
    np.testing.assert_allclose(_rows(strategy, sums), expected.sum(axis=1), rtol=1e-6)
    total = strategy.reduce("SUM", sums, axis=0)
    np.testing.assert_allclose(float(total), expected.sum(), rtol=1e-6)


def test_partial_batch_and_kd_function_give_the_unsplit_numbers():
    strategy = _tpu_strategy()

    def model(x):
        w = strategy.experimental_split_to_logical_devices(jnp.asarray(W), [1, 2])
        return x @ w

    # 9 rows on 2 replicas: 5 and 4, as TF splits them.
    (batch,) = list(strategy.experimental_distribute_dataset([X[:9]]))
    np.testing.assert_allclose(
        _rows(strategy, strategy.run(model, args=(batch,))), X[:9] @ W, rtol=1e-6
    )

    @kd.function
    def step(x):
        return strategy.reduce("SUM", strategy.run(model, args=(x,)), axis=0)

    (batch,) = list(strategy.experimental_distribute_dataset([X]))
    np.testing.assert_allclose(np.asarray(step(batch)), (X @ W).sum(axis=0), rtol=1e-6)


def test_the_compiled_program_really_partitions():
    strategy = _tpu_strategy()
    (batch,) = list(strategy.experimental_distribute_dataset([X]))

    def matmul(x):
        w = strategy.experimental_split_to_logical_devices(jnp.asarray(W), [1, 2])
        return x @ w

    np.testing.assert_allclose(
        _rows(strategy, strategy.run(matmul, args=(batch,))), X @ W, rtol=1e-6
    )
    entry = _entry(strategy)
    lowered = entry.lowered.as_text()
    # The mesh and the constraint on the logical axis are in the program.
    assert 'sdy.mesh @mesh = <["replica"=2, "logical"=2]>' in lowered
    constraint = (
        r'sdy.sharding_constraint %arg\d+ <@mesh, \[\{\}, \{"logical"\}\]> : tensor<3x8xf32>'
    )
    assert re.search(constraint, lowered), lowered
    assert 'manual_axes={"replica"}' in lowered
    # After partitioning, each device multiplies its 5 rows by half the kernel:
    # a 5x4 product, where the unsplit program computes 5x8.
    dots = [line for line in entry.compiled.as_text().splitlines() if " dot(" in line]
    assert len(dots) == 1 and "f32[5,4]" in dots[0].split("=")[1], dots

    plain = kd.MirroredStrategy(jax.devices("cpu")[:2])
    (plain_batch,) = list(plain.experimental_distribute_dataset([X]))
    plain.run(lambda x: x @ jnp.asarray(W), args=(plain_batch,))
    compiled = _entry(plain).compiled.as_text()
    plain_dots = [line for line in compiled.splitlines() if " dot(" in line]
    assert "f32[5,8]" in plain_dots[0].split("=")[1]


def test_outputs_and_variables_leave_the_program_whole():
    strategy = _tpu_strategy()
    with strategy.scope():
        kernel = keras.Variable(W)
    (batch,) = list(strategy.experimental_distribute_dataset([X]))

    def step(x):
        w = strategy.experimental_split_to_logical_devices(kernel.value, [1, 2])
        kernel.assign(w * 2.0)
        return x @ w

    outputs = strategy.run(step, args=(batch,))
    assert [np.shape(v) for v in strategy.experimental_local_results(outputs)] == [(5, 8)] * 2
    assert kernel.value.sharding.is_fully_replicated
    np.testing.assert_allclose(np.asarray(kernel.value), 2.0 * W)


def _split_dense_model(cores, weights=None):
    class SplitDense(keras.layers.Dense):
        def call(self, inputs):
            kernel = self.kernel
            if cores > 1:
                kernel = kd.get_strategy().experimental_split_to_logical_devices(kernel, [1, cores])
            return self.activation(keras.ops.matmul(inputs, kernel) + self.bias)

    model = keras.Sequential(
        [keras.Input((3,)), SplitDense(8, activation="relu"), keras.layers.Dense(1)]
    )
    if weights is not None:
        model.set_weights(weights)
    return model


@pytest.mark.parametrize("rows", [64, 58], ids=["even", "partial"])
def test_fit_with_split_kernels_equals_one_device(rows):
    rng = np.random.default_rng(1)
    x = rng.uniform(size=(rows, 3)).astype("float32")
    y = x @ np.array([[1.0], [-2.0], [0.5]], "float32")
    keras.utils.set_random_seed(0)
    weights = _split_dense_model(1).get_weights()
    results = []
    for strategy, cores in ((kd.OneDeviceStrategy("/cpu:0"), 1), (_tpu_strategy(), 2)):
        with strategy.scope():
            model = _split_dense_model(cores, weights)
            model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
        history = model.fit(x, y, batch_size=16, epochs=3, shuffle=False, verbose=0)
        results.append((history.history["loss"], model.get_weights()))
    # The train step was compiled with the kernel split over the logical axis.
    programs = [e.lowered.as_text() for e in strategy.extended._compiled._cache.values()]
    assert any('{"logical"}]> : tensor<3x8xf32>' in text for text in programs)
    (expected_loss, expected_weights), (loss, weights_after) = results
    np.testing.assert_allclose(loss, expected_loss, rtol=1e-5, atol=1e-5)
    for a, e in zip(weights_after, expected_weights):
        np.testing.assert_allclose(a, e, rtol=1e-5, atol=1e-5)


def test_argument_errors_follow_tf():
    strategy = _tpu_strategy()
    x = np.zeros((4, 6), "float32")
    with pytest.raises(ValueError, match=r"Length of `partition_dimensions`.*\(2\)"):
        strategy.experimental_split_to_logical_devices(x, [2])
    with pytest.raises(ValueError, match=r"partition_dimensions\[1\]`.*\(4\). Received: 6"):
        strategy.experimental_split_to_logical_devices(x, [1, 4])
    with pytest.raises(ValueError, match="one dimension.*Received: partition_dimensions"):
        _tpu_strategy(1, 4).experimental_split_to_logical_devices(x, [2, 2])
    with pytest.raises(ValueError, match="only total of 2 logical devices"):
        strategy.experimental_assign_to_logical_device(x, 2)
    with pytest.raises(ValueError, match="SPMD mode"):
        _tpu_strategy(spmd=True).experimental_assign_to_logical_device(x, 0)
    # Outside a compiled replica program the calls give the value back.
    assert strategy.experimental_split_to_logical_devices(x, [1, 2]) is x
    assert strategy.experimental_replicate_to_logical_devices(x) is x


def test_mirrored_assignment_argument_errors():
    with pytest.raises(ValueError, match="either `devices` or `experimental_device_assignment`"):
        kd.MirroredStrategy(["/cpu:0"], experimental_device_assignment=_assignment())
    strategy = kd.MirroredStrategy(["/cpu:0", "/cpu:1"])
    with pytest.raises(ValueError, match="product of `partition_dimensions`"):
        strategy.experimental_split_to_logical_devices(np.zeros((2, 2)), [1, 2])


def test_the_example_trains_split_kernels_with_the_unsplit_loss():
    result = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "tpu_logical_devices.py"), "--epochs", "2"],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "logical devices on" in result.stdout
    assert "loss matches the unsplit run" in result.stdout
