"""Workers with different numbers of devices: worker 0 with 2, worker 1 with 4.

TF cannot run such a cluster (tensorflow#47203: "group_size 8 but that group has
size 4"). Here the mesh holds all 6 devices, each worker feeds its own replicas'
rows of every global batch, and ``fit`` gives one device's numbers on the same
global batches. Simulated with a different ``--xla_force_host_platform_device_count``
per process (``devices_per_worker=[2, 4]``).
"""

import time

import numpy as np
import pytest

import keras_dist as kd
from keras_dist import testing

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(300)]

TIMEOUT = 180
ROWS, BATCH = 69, 12  # the last global batch has 9 rows for 6 replicas


def _model():
    import keras

    model = keras.Sequential(
        [keras.Input((3,)), keras.layers.Dense(4, activation="relu"), keras.layers.Dense(1)]
    )
    model.compile(optimizer=keras.optimizers.SGD(0.1, momentum=0.5), loss="mse", metrics=["mae"])
    return model


def _data():
    x = np.random.default_rng(0).normal(size=(ROWS, 3)).astype("float32")
    return x, x.sum(axis=1, keepdims=True)


def _flat(weights):
    return np.concatenate([np.ravel(w) for w in weights])


def _fit_worker():
    import jax.numpy as jnp
    import keras

    strategy = kd.MultiWorkerMirroredStrategy()
    keras.utils.set_random_seed(strategy.cluster_resolver.task_id)
    with strategy.scope():
        model = _model()
    initial = _flat(model.get_weights())
    x, y = _data()
    history = model.fit(x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0)

    contexts = []

    def dataset_fn(context):
        contexts.append(
            (
                context.num_input_pipelines,
                context.input_pipeline_id,
                context.get_per_replica_batch_size(BATCH),
            )
        )
        rows = np.arange(48, dtype="float32")[context.input_pipeline_id :: 2]
        size = context.get_per_replica_batch_size(BATCH)
        return [rows[i : i + size] for i in range(0, len(rows), size)]

    def total(batch):
        return strategy.reduce("SUM", strategy.run(jnp.sum, args=(batch,)), axis=None)

    per_worker = strategy.distribute_datasets_from_function(dataset_fn)
    global_batches = [np.arange(30, dtype="float32")[i : i + BATCH] for i in range(0, 30, BATCH)]
    ids = strategy.run(lambda: kd.get_replica_context().replica_id_in_sync_group)
    return {
        "replicas": (strategy.num_replicas_in_sync, strategy.extended.num_local_replicas),
        "ids": [int(np.asarray(c)) for c in strategy.experimental_local_results(ids)],
        "initial": initial,
        "final": _flat(model.get_weights()),
        "history": history.history,
        "evaluate": model.evaluate(x, y, batch_size=BATCH, verbose=0),
        "predict": model.predict(x[:10], batch_size=6, verbose=0),
        "contexts": contexts,
        "per_worker_sums": [float(total(b)) for b in per_worker],
        "global_sums": [
            float(total(b)) for b in strategy.experimental_distribute_dataset(global_batches)
        ],
    }


def test_fit_on_workers_with_2_and_4_devices_equals_one_device():
    small, large = kd.launch(
        _fit_worker, num_workers=2, devices_per_worker=[2, 4], timeout=TIMEOUT, stream_output=False
    )
    assert small["replicas"] == (6, 2) and large["replicas"] == (6, 4)
    assert small["ids"] == [0, 1] and large["ids"] == [2, 3, 4, 5]
    np.testing.assert_array_equal(small["initial"], large["initial"])
    np.testing.assert_array_equal(small["final"], large["final"])
    # One device from the same first weights on the same global batches.
    model = _model()
    shapes = [w.shape for w in model.get_weights()]
    pieces = np.split(small["initial"], np.cumsum([int(np.prod(s)) for s in shapes])[:-1])
    model.set_weights([w.reshape(s) for w, s in zip(pieces, shapes)])
    x, y = _data()
    history = model.fit(x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0)
    np.testing.assert_allclose(small["final"], _flat(model.get_weights()), atol=1e-5)
    for result in (small, large):
        for key, values in history.history.items():
            np.testing.assert_allclose(result["history"][key], values, rtol=1e-5)
        expected = model.evaluate(x, y, batch_size=BATCH, verbose=0)
        np.testing.assert_allclose(result["evaluate"], expected, rtol=1e-5)
        np.testing.assert_allclose(result["predict"], model.predict(x[:10], verbose=0), atol=1e-5)
    # One pipeline per worker, batched per replica: worker 0 reads 2 of its batches a
    # step, worker 1 reads 4; every row is read once, and both agree on the steps.
    assert small["contexts"] == [(2, 0, 2)] and large["contexts"] == [(2, 1, 2)]
    assert small["per_worker_sums"] == large["per_worker_sums"]
    assert sum(small["per_worker_sums"]) == sum(range(48))
    assert small["per_worker_sums"][0] == sum([0, 2, 4, 6]) + sum(range(1, 16, 2))
    # A distributed global batch is split by replica: each row once, in order.
    assert small["global_sums"] == large["global_sums"] == [66.0, 210.0, 159.0]


def _between_graph_task():
    import keras

    strategy = kd.ParameterServerStrategy()  # the ps task serves here until it is stopped
    rng = np.random.default_rng(0)
    x = rng.normal(size=(128, 8)).astype("float32")
    y = (x @ rng.normal(size=(8, 1))).astype("float32")
    index = strategy.extended.worker_index
    keras.utils.set_random_seed(1337)
    with strategy.scope():
        model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(1)])
        model.compile(keras.optimizers.SGD(0.05), "mse")
    before = model.evaluate(x, y, verbose=0)
    model.fit(x[index::2], y[index::2], batch_size=16, epochs=3, verbose=0)
    deadline = time.monotonic() + 120
    while int(model.optimizer.iterations.numpy()) < 24 and time.monotonic() < deadline:
        time.sleep(0.1)
    return {
        "devices": len(strategy.extended.worker_devices),
        "iterations": int(model.optimizer.iterations.numpy()),
        "before": float(before),
        "after": float(model.evaluate(x, y, verbose=0)),
    }


def test_parameter_server_workers_with_2_and_4_devices_train_shared_variables():
    cluster = testing.create_cluster_spec(num_workers=2, num_ps=1)
    runner = testing.MultiProcessRunner(
        _between_graph_task,
        cluster,
        env={"KERAS_DIST_CLUSTER_TOKEN": "different-devices"},
        devices_per_worker=[2, 4, 1],  # worker 0, worker 1, ps 0
        stream_output=False,
        dependence_on_chief=False,
    )
    with runner:
        runner.start()
        deadline = time.monotonic() + TIMEOUT
        while time.monotonic() < deadline:
            states = runner.process_status()
            if all(states[("worker", i)].state != "running" for i in (0, 1)):
                break
            time.sleep(0.2)
        runner.terminate("ps", 0)
        results = [r for r in runner.join(timeout=60) if r is not None]
    assert [r["devices"] for r in results] == [2, 4]
    for result in results:
        assert result["iterations"] == 2 * 3 * 4  # both workers' steps, each applied once
        assert result["after"] < 0.2 * result["before"]


def test_a_device_count_per_task_must_match_the_tasks():
    with pytest.raises(ValueError, match=r"one count per task \(2: worker 0, worker 1\)"):
        kd.launch(_fit_worker, num_workers=2, devices_per_worker=[2, 4, 1], timeout=10)
