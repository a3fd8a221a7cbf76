"""Optimizer updates applied on the parameter servers, and a worker's devices.

With a gradient that does not depend on the weights, the order in which
asynchronous workers' steps reach the ps does not matter: when every update
runs on the ps, on the values there, N steps on two workers give exactly the
optimizer's N sequential steps on one device. Updates computed on a worker
from values it read earlier lose steps (the momentum of one worker's step
overwrites another's), so these numbers fail there.
"""

import gc
import time
import weakref

import jax
import keras
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import keras_dist as kd
from keras_dist.experimental import partitioners
from keras_dist.parameter_server.tasks._worker_service import spread_over

pytestmark = pytest.mark.timeout(180)

GRADIENT = np.array([1.0, -2.0, 0.5, 3.0], np.float32)
STEPS = 40


@pytest.fixture(scope="module")
def two_workers_two_ps():
    return kd.testing.create_in_process_cluster(num_workers=2, num_ps=2)


def _sequential(make_optimizer, steps=STEPS):
    """``steps`` updates from the constant gradients on one device: the expected values."""
    kernel, bias = keras.Variable(np.ones(4, np.float32)), keras.Variable(np.zeros(2, np.float32))
    optimizer = make_optimizer()
    optimizer.build([kernel, bias])
    for _ in range(steps):
        optimizer.apply([GRADIENT, np.ones(2, np.float32)], [kernel, bias])
    return kernel.numpy(), bias.numpy()


def _scheduled(strategy, make_optimizer, steps=STEPS, partitioned=False):
    with strategy.scope():
        kernel = keras.Variable(np.ones(4, np.float32), name="kernel")
        bias = keras.Variable(np.zeros(2, np.float32), name="bias")
        optimizer = make_optimizer()
        optimizer.build([kernel, bias])
    coordinator = kd.coordinator.ClusterCoordinator(strategy)

    def step():
        grads = [keras.ops.convert_to_tensor(GRADIENT), keras.ops.ones((2,))]
        optimizer.apply(grads, [kernel, bias])

    for _ in range(steps):
        coordinator.schedule(step)
    coordinator.join()
    return kernel, bias, optimizer


OPTIMIZERS = {
    "sgd-momentum": lambda: keras.optimizers.SGD(0.1, momentum=0.9),
    "nesterov-clipnorm": lambda: keras.optimizers.SGD(
        0.1, momentum=0.9, nesterov=True, global_clipnorm=1.0
    ),
    "rmsprop": lambda: keras.optimizers.RMSprop(0.01),
    "adamw": lambda: keras.optimizers.AdamW(0.01, weight_decay=0.1),
}


@pytest.mark.parametrize("name", ["sgd-momentum", "nesterov-clipnorm", "rmsprop"])
def test_concurrent_steps_give_the_sequential_updates(two_workers_two_ps, name):
    strategy = kd.ParameterServerStrategy(two_workers_two_ps)
    kernel, bias, optimizer = _scheduled(strategy, OPTIMIZERS[name])
    expected_kernel, expected_bias = _sequential(OPTIMIZERS[name])
    assert int(optimizer.iterations.numpy()) == STEPS
    np.testing.assert_allclose(kernel.numpy(), expected_kernel, rtol=2e-5, atol=1e-6)
    np.testing.assert_allclose(bias.numpy(), expected_bias, rtol=2e-5, atol=1e-6)


def test_adam_on_one_ps_reads_the_iteration_count_there():
    # The iteration count lives on the task that runs the update: Adam's bias
    # correction sees every step, even when two workers' steps overlap.
    strategy = kd.ParameterServerStrategy(
        kd.testing.create_in_process_cluster(num_workers=2, num_ps=1)
    )
    kernel, bias, optimizer = _scheduled(strategy, OPTIMIZERS["adamw"])
    expected_kernel, expected_bias = _sequential(OPTIMIZERS["adamw"])
    assert int(optimizer.iterations.numpy()) == STEPS
    np.testing.assert_allclose(kernel.numpy(), expected_kernel, rtol=2e-5, atol=1e-6)
    np.testing.assert_allclose(bias.numpy(), expected_bias, rtol=2e-5, atol=1e-6)


def test_slots_live_beside_their_variables(two_workers_two_ps):
    strategy = kd.ParameterServerStrategy(
        two_workers_two_ps, variable_partitioner=partitioners.FixedShardsPartitioner(2)
    )
    with strategy.scope():
        table = keras.Variable(np.zeros((6, 2), np.float32), name="table")
        scale = keras.Variable(1.0, name="scale")
        optimizer = keras.optimizers.Adam()
        optimizer.build([table, scale])
    # Keras names the optimizer "adam", "adam_1"... in one process.
    slots = {v.path.split("/", 1)[1]: v for v in optimizer.variables}
    for slot in ("table_momentum", "table_velocity"):
        assert [s.device for s in slots[slot].variables] == [s.device for s in table.variables]
        assert [s.shape for s in slots[slot].variables] == [(3, 2), (3, 2)]
    assert slots["scale_momentum"].device == scale.device


@pytest.mark.parametrize("name", ["sgd-momentum", "adamw"])
def test_each_shard_of_a_partitioned_variable_is_updated_on_its_task(two_workers_two_ps, name):
    # As TF updates each shard of a ShardedVariable as a variable of its own;
    # for elementwise optimizers that is the whole variable's update.
    strategy = kd.ParameterServerStrategy(
        two_workers_two_ps, variable_partitioner=partitioners.FixedShardsPartitioner(2)
    )
    kernel, bias, optimizer = _scheduled(strategy, OPTIMIZERS[name])
    expected_kernel, expected_bias = _sequential(OPTIMIZERS[name])
    assert [s.device for s in kernel.variables] == [
        "/job:ps/replica:0/task:0/device:CPU:0",
        "/job:ps/replica:0/task:1/device:CPU:0",
    ]
    assert int(optimizer.iterations.numpy()) == STEPS
    # Two workers at once: exact where the task holds the iteration count
    # (Adam's bias correction reads it), within a step's lag elsewhere.
    tolerance = 2e-5 if name == "sgd-momentum" else 2e-2
    np.testing.assert_allclose(kernel.numpy(), expected_kernel, rtol=tolerance, atol=1e-6)
    np.testing.assert_allclose(bias.numpy(), expected_bias, rtol=tolerance, atol=1e-6)


def _mean_output_model():
    # The loss is the mean prediction: its gradient is the batch's mean row,
    # the same for every batch of identical rows, whatever the weights.
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1, use_bias=False)])
    model.compile(keras.optimizers.SGD(0.05, momentum=0.9), lambda y, p: keras.ops.mean(p))
    model.layers[0].kernel.assign(np.ones((4, 1), np.float32))
    return model


def test_fit_on_two_workers_applies_every_step_on_the_ps(two_workers_two_ps):
    x = np.tile(GRADIENT, (256, 1))
    y = np.zeros((256, 1), np.float32)
    plain = _mean_output_model()
    plain.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0)
    strategy = kd.ParameterServerStrategy(two_workers_two_ps)
    with strategy.scope():
        model = _mean_output_model()
    model.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0)
    assert int(model.optimizer.iterations.numpy()) == 32
    np.testing.assert_allclose(model.get_weights()[0], plain.get_weights()[0], rtol=2e-5)


def test_a_collected_variable_is_freed_on_its_ps_task(two_workers_two_ps):
    strategy = kd.ParameterServerStrategy(two_workers_two_ps)
    servers = strategy.extended.parameter_servers
    with strategy.scope():
        kept = keras.Variable(np.ones(3, np.float32))
        dropped = keras.Variable(np.full(1000, 2.0, np.float32))
    location = dropped.location
    assert servers.read([location])[0][0] == 2.0
    del dropped
    gc.collect()
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            servers.read([location])
        except kd.errors.NotFoundError:
            break
        time.sleep(0.05)
    else:
        raise AssertionError("the collected variable is still stored on its ps task")
    np.testing.assert_array_equal(kept.numpy(), np.ones(3))


# -------------------------------------------- between-graph: local devices in sync
def test_between_graph_worker_splits_each_step_over_its_local_devices():
    # This process has 8 CPU devices (conftest): a worker task running fit
    # itself splits every batch of 32 over them, and gets one device's numbers.
    cluster = kd.testing.create_in_process_cluster(num_workers=1, num_ps=1)
    as_worker = kd.cluster_resolver.SimpleClusterResolver(
        cluster.cluster_spec(), task_type="worker", task_id=0
    )
    strategy = kd.ParameterServerStrategy(as_worker)
    assert strategy.extended.experimental_between_graph
    assert len(strategy.extended.worker_devices) == jax.local_device_count() == 8
    x = np.random.default_rng(0).normal(size=(128, 4)).astype("float32")
    y = x @ np.arange(1.0, 5.0, dtype="float32")[:, None]

    def build():
        keras.utils.set_random_seed(7)
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(8), keras.layers.Dense(1)])
        model.compile(keras.optimizers.SGD(0.05, momentum=0.9), "mse")
        return model

    plain = build()
    expected = plain.fit(x, y, batch_size=32, epochs=3, shuffle=False, verbose=0)
    with strategy.scope():
        model = build()
    history = model.fit(x, y, batch_size=32, epochs=3, shuffle=False, verbose=0)
    # Equal up to the order of the summed rows (8 partial sums, then the all-reduce).
    np.testing.assert_allclose(history.history["loss"], expected.history["loss"], rtol=1e-5)
    for mine, theirs in zip(model.get_weights(), plain.get_weights()):
        np.testing.assert_allclose(mine, theirs, rtol=1e-5, atol=1e-5)


def test_spread_over_splits_batches_and_copies_the_rest():
    mesh = jax.sharding.Mesh(np.array(jax.local_devices()[:4]), ("replica",))
    weights, batch, ragged, index = np.ones((3, 2)), np.ones((8, 3)), np.ones((6, 3)), np.int32(0)
    placed = spread_over(mesh, [weights, batch, ragged, index], range(1, 3))
    assert [p.sharding.spec for p in placed] == [P(), P("replica"), P(), P()]
    assert placed[1].addressable_shards[0].data.shape == (2, 3)


# ------------------------------------ functions that use what their update changes
def _one_variable(strategy, value, optimizer):
    with strategy.scope():
        w = keras.Variable(np.full(2, value, np.float32), name="w")
        optimizer = optimizer()
        optimizer.build([w])
    return w, optimizer, kd.coordinator.ClusterCoordinator(strategy)


def test_a_value_read_after_the_update_is_the_updated_one(two_workers_two_ps):
    w, optimizer, coordinator = _one_variable(
        kd.ParameterServerStrategy(two_workers_two_ps), 1.0, lambda: keras.optimizers.SGD(0.5)
    )

    def step():
        optimizer.apply([w.value], [w])  # the gradient is the value itself
        return w.value

    np.testing.assert_allclose(coordinator.schedule(step).fetch(), [0.5, 0.5])
    np.testing.assert_allclose(coordinator.schedule(step).fetch(), [0.25, 0.25])


def test_a_learning_rate_set_in_the_step_is_the_one_used(two_workers_two_ps):
    w, optimizer, coordinator = _one_variable(
        kd.ParameterServerStrategy(two_workers_two_ps), 0.0, lambda: keras.optimizers.SGD(1.0)
    )

    def step():
        optimizer.learning_rate.assign(0.1)  # a warm-up set inside the step
        optimizer.apply([keras.ops.ones((2,))], [w])

    coordinator.schedule(step)
    coordinator.join()
    np.testing.assert_allclose(w.numpy(), [-0.1, -0.1], rtol=1e-6)


def test_one_optimizer_applied_twice_in_a_step_counts_both():
    # The second update reads the first's results: both run in order, on the
    # worker (one worker here, so the numbers are the sequential ones).
    cluster = kd.testing.create_in_process_cluster(num_workers=1, num_ps=2)
    w, optimizer, coordinator = _one_variable(
        kd.ParameterServerStrategy(cluster), 1.0, lambda: keras.optimizers.Adam(0.1)
    )
    reference = keras.Variable(np.ones(2, np.float32))
    expected_optimizer = keras.optimizers.Adam(0.1)

    def step():
        optimizer.apply([w.value], [w])
        optimizer.apply([w.value], [w])

    for _ in range(3):
        coordinator.schedule(step)
    coordinator.join()
    for _ in range(6):
        expected_optimizer.apply([reference.value], [reference])
    assert int(optimizer.iterations.numpy()) == 6
    np.testing.assert_allclose(w.numpy(), reference.numpy(), rtol=1e-5)


def test_a_constrained_variable_stays_constrained_with_concurrent_workers(two_workers_two_ps):
    strategy = kd.ParameterServerStrategy(two_workers_two_ps)
    with strategy.scope():
        layer = keras.layers.Dense(2, kernel_constraint="non_neg", use_bias=False)
        layer.build((None, 1))
        layer.kernel.assign(np.full((1, 2), 0.1, np.float32))
        optimizer = keras.optimizers.SGD(1.0)
        optimizer.build([layer.kernel])
    coordinator = kd.coordinator.ClusterCoordinator(strategy)
    matrix = np.random.default_rng(0).normal(size=(256, 256)).astype(np.float32)

    def step(m):
        x = m
        for _ in range(20):  # long enough for both workers to read before either writes
            x = keras.ops.tanh(x @ m)
        optimizer.apply([keras.ops.ones((1, 2)) + 0.0 * keras.ops.sum(x)], [layer.kernel])

    for _ in range(4):
        coordinator.schedule(step, args=(matrix,))
    coordinator.join()
    np.testing.assert_array_equal(layer.kernel.numpy(), np.zeros((1, 2)))  # set, not summed


def test_a_model_dropped_while_its_steps_are_queued_still_runs_them(two_workers_two_ps):
    strategy = kd.ParameterServerStrategy(two_workers_two_ps)
    coordinator = kd.coordinator.ClusterCoordinator(strategy)

    def make_step():
        with strategy.scope():
            model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
            model.layers[0].kernel.assign(np.ones((4, 2), np.float32))

        def step(x):
            return keras.ops.sum(model(x))

        return step

    results = [coordinator.schedule(make_step(), args=(np.ones((8, 4), np.float32),))]
    results += [coordinator.schedule(make_step(), args=(np.ones((8, 4), np.float32),))]
    gc.collect()
    coordinator.join()
    assert [float(r.fetch()) for r in results] == [64.0, 64.0]


def test_variables_of_finished_steps_are_not_kept_alive(two_workers_two_ps):
    strategy = kd.ParameterServerStrategy(two_workers_two_ps)
    coordinator = kd.coordinator.ClusterCoordinator(strategy)

    def train_and_drop():
        with strategy.scope():
            w = keras.Variable(np.ones(2, np.float32))
        coordinator.schedule(lambda: w.assign_add(keras.ops.ones((2,))))
        coordinator.join()
        return weakref.ref(w)

    collected = train_and_drop()
    deadline = time.monotonic() + 10
    while collected() is not None and time.monotonic() < deadline:
        gc.collect()
        time.sleep(0.1)
    assert collected() is None  # nothing of the finished step holds it
