"""A tf.distribute custom training loop gives one device's weights on several replicas."""

import os
import subprocess
import sys
from pathlib import Path

import keras
import numpy as np
import pytest
from conftest import cpus

import keras_dist as kd

ROOT = Path(__file__).resolve().parents[2]


def _data(rows=96, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(rows, 8)).astype("float32")
    y = (x[:, 0] + x[:, 1] > 0).astype("int32") + (x[:, 2] > 1).astype("int32")
    return x, y


def _train(strategy, batches, epochs=3, optimizer_fn=lambda: keras.optimizers.SGD(0.1)):
    keras.utils.set_random_seed(7)
    with strategy.scope():
        model = keras.Sequential(
            [
                keras.Input((8,)),
                keras.layers.Dense(16, activation="relu"),
                keras.layers.Dense(16, activation="tanh", kernel_regularizer="l2"),
                keras.layers.Dense(3),
            ]
        )
        optimizer = optimizer_fn()
    loss_object = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction=None)

    def step(inputs, global_batch_size):
        x, y = inputs

        def loss_fn():
            loss = kd.nn.compute_average_loss(
                loss_object(y, model(x, training=True)), global_batch_size=global_batch_size
            )
            return loss + kd.nn.scale_regularization_loss(model.losses)

        loss, grads = kd.value_and_grad(loss_fn, model.trainable_variables)()
        optimizer.apply_gradients(zip(grads, model.trainable_variables))
        return loss

    dataset = strategy.experimental_distribute_dataset(batches)
    losses = []
    for _ in range(epochs):
        for (x, y), global_batch in zip(dataset, batches):
            per_replica = strategy.run(step, args=((x, y), len(global_batch[0])))
            losses.append(float(strategy.reduce("SUM", per_replica, axis=None)))
    return [w.numpy() for w in model.weights], losses, int(optimizer.iterations.numpy())


def _batches(x, y, size):
    return [(x[i : i + size], y[i : i + size]) for i in range(0, len(x), size)]


@pytest.mark.parametrize(
    "optimizer_fn",
    [lambda: keras.optimizers.SGD(0.1, momentum=0.9), lambda: keras.optimizers.Adam(0.01)],
    ids=["sgd-momentum", "adam"],
)
def test_four_replicas_end_with_one_device_weights(engine, optimizer_fn):
    x, y = _data()
    batches = _batches(x, y, 16)
    reference = _train(kd.OneDeviceStrategy("/cpu:0"), batches, optimizer_fn=optimizer_fn)
    mirrored = _train(kd.MirroredStrategy(cpus(4)), batches, optimizer_fn=optimizer_fn)
    assert mirrored[2] == reference[2] == 3 * len(batches)
    np.testing.assert_allclose(mirrored[1], reference[1], atol=1e-5)
    for got, want in zip(mirrored[0], reference[0]):
        np.testing.assert_allclose(got, want, atol=1e-5)


def test_partial_last_batch_matches_one_device():
    # 90 rows in batches of 16: the last global batch (10 rows) is split 3, 3, 2, 2
    # and runs through the eager engine automatically.
    x, y = _data(rows=90)
    batches = _batches(x, y, 16)
    reference = _train(kd.OneDeviceStrategy("/cpu:0"), batches, epochs=2)
    mirrored = _train(kd.MirroredStrategy(cpus(4)), batches, epochs=2)
    np.testing.assert_allclose(mirrored[1], reference[1], atol=1e-5)
    for got, want in zip(mirrored[0], reference[0]):
        np.testing.assert_allclose(got, want, atol=1e-5)


def test_last_batch_smaller_than_replica_count_gives_empty_replicas():
    x, y = _data(rows=34)
    batches = _batches(x, y, 16)  # last batch: 2 rows on 4 replicas -> 1, 1, 0, 0
    reference = _train(kd.OneDeviceStrategy("/cpu:0"), batches, epochs=1)
    mirrored = _train(kd.MirroredStrategy(cpus(4)), batches, epochs=1)
    for got, want in zip(mirrored[0], reference[0]):
        np.testing.assert_allclose(got, want, atol=1e-5)


@pytest.mark.parametrize(
    "make_strategy",
    [lambda: kd.OneDeviceStrategy("/cpu:0"), lambda: kd.MirroredStrategy(cpus(2)),
     lambda: kd.experimental.CentralStorageStrategy(cpus(2))],
    ids=["one_device", "mirrored", "central_storage"],
)  # fmt: skip
def test_apply_gradients_in_the_cross_replica_context_applies_them_once(make_strategy):
    # Outside ``strategy.run`` the gradients are the caller's whole batch's: applied
    # once, as one device applies them (TF refuses; docs/differences.md).
    strategy = make_strategy()
    with strategy.scope():
        model = keras.Sequential([keras.Input((1,)), keras.layers.Dense(1)])
        optimizer = keras.optimizers.SGD(0.5)
    before = [w.numpy() for w in model.weights]
    grads = [np.ones(w.shape, "float32") for w in model.trainable_variables]
    with strategy.scope():
        optimizer.apply_gradients(zip(grads, model.trainable_variables))
    for got, want in zip(model.weights, before):
        np.testing.assert_allclose(got.numpy(), want - 0.5, atol=1e-6)
        for copy in strategy.experimental_local_results(got):
            np.testing.assert_allclose(np.asarray(copy), want - 0.5, atol=1e-6)
    assert int(optimizer.iterations.numpy()) == 1

    # In a replica it applies the replicas' summed gradients once.
    def step():
        ones = [keras.ops.ones(w.shape) for w in model.trainable_variables]
        optimizer.apply_gradients(zip(ones, model.trainable_variables))

    strategy.run(step)
    replicas = strategy.num_replicas_in_sync
    for got, want in zip(model.weights, before):
        np.testing.assert_allclose(got.numpy(), want - 0.5 - 0.5 * replicas, atol=1e-6)
    assert int(optimizer.iterations.numpy()) == 2


def test_custom_training_loop_example_learns_digits():
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=4")
    result = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "custom_training_loop.py"), "--epochs", "3"],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "4 replicas" in result.stdout
    accuracy = float(result.stdout.strip().splitlines()[-1].split(":")[-1])
    assert accuracy > 0.85, result.stdout
