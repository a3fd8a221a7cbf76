"""A step whose replicas get different numbers of rows is compiled, and gives the eager numbers.

TF splits a last batch of 10 rows on 4 replicas as 3/3/3/1: one SPMD program
cannot take it, and the uneven engine traces the replicas into one program.
"""

import jax.numpy as jnp
import keras
import numpy as np
import pytest
from conftest import cpus

import keras_dist as kd


def _data(rows, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(rows, 6)).astype("float32")
    y = (x[:, 0] - x[:, 3] > 0).astype("int32")
    return x, y


def _tutorial_loop(strategy, batches, epochs=2):
    """TF's custom-training tutorial as ported: closure per call, metrics, SUM of losses."""
    keras.utils.set_random_seed(3)
    with strategy.scope():
        model = keras.Sequential(
            [keras.Input((6,)), keras.layers.Dense(12, activation="relu"), keras.layers.Dense(2)]
        )
        optimizer = keras.optimizers.Adam(0.01)
        accuracy = keras.metrics.SparseCategoricalAccuracy()
        test_loss = keras.metrics.Mean()
    loss_object = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction=None)
    global_batch = len(batches[0][0])

    def train_step(inputs):
        def step_fn(inputs):
            x, y = inputs

            def loss_fn():
                logits = model(x, training=True)
                per_example = loss_object(y, logits)
                loss = kd.nn.compute_average_loss(per_example, global_batch_size=global_batch)
                return loss, logits

            (loss, logits), grads = kd.value_and_grad(
                loss_fn, model.trainable_variables, has_aux=True
            )()
            optimizer.apply_gradients(zip(grads, model.trainable_variables))
            accuracy.update_state(y, logits)
            test_loss.update_state(loss_object(y, logits))
            return loss

        per_replica = strategy.run(step_fn, args=(inputs,))
        return strategy.reduce("SUM", per_replica, axis=None)

    dataset = strategy.experimental_distribute_dataset(batches)
    losses = []
    for _ in range(epochs):
        for inputs in dataset:
            losses.append(float(train_step(inputs)))
    return {
        "losses": losses,
        "weights": [np.asarray(w.value) for w in model.weights],
        "accuracy": float(accuracy.result()),
        "mean": float(test_loss.result()),
        "iterations": int(optimizer.iterations.value),
    }


def _batches(rows, size):
    x, y = _data(rows)
    return [(x[i : i + size], y[i : i + size]) for i in range(0, rows, size)]


@pytest.mark.parametrize("rows", [42, 33], ids=["last-10-rows", "last-1-row"])
def test_tutorial_loop_with_partial_batch_matches_one_device_and_eager(rows):
    batches = _batches(rows, 16)  # last batch 10 rows -> 3/3/3/1, or 1 row -> 1/0/0/0
    reference = _tutorial_loop(kd.OneDeviceStrategy("/cpu:0"), batches)
    strategy = kd.MirroredStrategy(cpus(4))
    compiled = _tutorial_loop(strategy, batches)
    kd.config.run_functions_eagerly(True)
    eager = _tutorial_loop(kd.MirroredStrategy(cpus(4)), batches)
    kd.config.run_functions_eagerly(False)
    for got in (compiled, eager):
        np.testing.assert_allclose(got["losses"], reference["losses"], atol=1e-5)
        for w, want in zip(got["weights"], reference["weights"]):
            np.testing.assert_allclose(w, want, atol=1e-5)
        assert got["accuracy"] == pytest.approx(reference["accuracy"], abs=1e-6)
        assert got["mean"] == pytest.approx(reference["mean"], abs=1e-5)
        assert got["iterations"] == reference["iterations"] == 2 * len(batches)
    # The closure is new on every call, yet the partial batch was traced once for
    # both epochs: one compile, then a cached program.
    assert strategy.extended._uneven.trace_count == 1


def test_all_reduce_of_a_plain_value_and_mean_give_one_value_per_replica(engine):
    strategy = kd.MirroredStrategy(cpus(4))
    batch = np.arange(10, dtype="float32")  # 3/3/3/1 rows
    (data,) = list(strategy.experimental_distribute_dataset([batch]))

    def fn(x):
        ctx = kd.get_replica_context()
        plain = ctx.all_reduce("SUM", jnp.float32(2.0))
        rows = ctx.all_reduce("SUM", jnp.float32(x.shape[0]))
        mean = ctx.all_reduce("MEAN", jnp.sum(x))
        return plain, rows, mean

    plain, rows, mean = strategy.run(fn, args=(data,))
    assert [float(v) for v in strategy.experimental_local_results(plain)] == [8.0] * 4
    assert [float(v) for v in strategy.experimental_local_results(rows)] == [10.0] * 4
    assert [float(v) for v in strategy.experimental_local_results(mean)] == [45.0 / 4] * 4


def test_uneven_outputs_gather_and_reduce_along_the_batch_axis(engine):
    strategy = kd.MirroredStrategy(cpus(4))
    batch = np.arange(20, dtype="float32").reshape(10, 2)
    (data,) = list(strategy.experimental_distribute_dataset([batch]))

    def fn(x):
        gathered = kd.get_replica_context().all_gather(x * 2.0, axis=0)
        return x + 1.0, gathered

    out, gathered = strategy.run(fn, args=(data,))
    shapes = [np.shape(v) for v in strategy.experimental_local_results(out)]
    assert shapes == [(3, 2), (3, 2), (3, 2), (1, 2)]
    np.testing.assert_allclose(strategy.gather(out, axis=0), batch + 1.0)
    np.testing.assert_allclose(strategy.reduce("MEAN", out, axis=0), (batch + 1.0).mean(0))
    np.testing.assert_allclose(strategy.reduce("SUM", out, axis=0), (batch + 1.0).sum(0))
    for replica in strategy.experimental_local_results(gathered):
        np.testing.assert_allclose(replica, batch * 2.0)


def test_sync_on_read_and_mirrored_writes_on_an_uneven_batch(engine):
    strategy = kd.MirroredStrategy(cpus(4))
    with strategy.scope():
        rows_seen = keras.Variable(0.0, synchronization="on_read", aggregation="sum")
        total = keras.Variable(0.0, aggregation="sum")
        first = keras.Variable(0.0, aggregation="only_first_replica")
    batch = np.arange(10, dtype="float32")
    (data,) = list(strategy.experimental_distribute_dataset([batch]))

    def fn(x):
        rows_seen.assign_add(jnp.float32(x.shape[0]))
        total.assign_add(jnp.sum(x))
        first.assign(jnp.sum(x))

    strategy.run(fn, args=(data,))
    strategy.run(fn, args=(data,))
    components = [float(c) for c in strategy.experimental_local_results(rows_seen)]
    assert components == [6.0, 6.0, 6.0, 2.0]
    assert float(rows_seen.value) == 20.0
    assert float(total.value) == 90.0
    assert float(first.value) == 0.0 + 1.0 + 2.0  # replica 0's rows: 0, 1, 2


def test_kd_function_with_a_partial_batch_compiles_the_uneven_step_once():
    strategy = kd.MirroredStrategy(cpus(4))
    with strategy.scope():
        total = keras.Variable(0.0, aggregation="sum")

    @kd.function
    def step(x):
        def fn(x):
            total.assign_add(jnp.sum(x))
            return jnp.sum(x)

        return strategy.reduce("SUM", strategy.run(fn, args=(x,)), axis=None)

    batches = [np.ones(8, "float32"), np.ones(6, "float32")]  # 2/2/2/2, then 2/2/2/0
    dataset = strategy.experimental_distribute_dataset(batches)
    results = [float(step(x)) for _ in range(3) for x in dataset]
    assert results == [8.0, 6.0] * 3
    assert float(total.value) == 42.0
    assert strategy.extended._uneven.trace_count == 1


def test_a_collective_inside_a_gradient_on_an_uneven_batch_is_refused():
    strategy = kd.MirroredStrategy(cpus(2))
    with strategy.scope():
        w = keras.Variable(1.0)
    (data,) = list(strategy.experimental_distribute_dataset([np.ones(3, "float32")]))

    def fn(x):
        def loss_fn():
            ctx = kd.get_replica_context()
            return ctx.all_reduce("SUM", jnp.sum(x * w.value))

        return kd.value_and_grad(loss_fn, [w])()

    with pytest.raises(RuntimeError, match="all_reduce.*traced"):
        strategy.run(fn, args=(data,))
