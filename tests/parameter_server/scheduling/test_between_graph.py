"""Between-graph ParameterServerStrategy: every worker task runs the training program itself.

Two worker processes and one ps process start from TF_CONFIG and run the same
function: the ps task serves (creating the strategy there serves until the
job ends), each worker fits on its half of the data, asynchronously with the
other, on the shared variables. Both then read the same final weights, and
the optimizer counted every step of both workers.
"""

import time

import numpy as np
import pytest

from keras_dist import testing

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(240)]

EPOCHS, ROWS, BATCH = 4, 128, 16


def _between_graph_task():
    import os

    import keras
    import numpy as np

    import keras_dist as kd

    strategy = kd.ParameterServerStrategy()  # on the ps task this serves until terminated
    extended = strategy.extended
    rng = np.random.default_rng(0)
    x = rng.normal(size=(2 * ROWS, 8)).astype("float32")
    y = (x @ rng.normal(size=(8, 1))).astype("float32")
    index = extended.worker_index
    keras.utils.set_random_seed(1337)
    with strategy.scope():
        model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(1)])
        model.compile(keras.optimizers.SGD(0.05), "mse")
    before = model.evaluate(x, y, verbose=0)
    history = model.fit(x[index::2], y[index::2], batch_size=BATCH, epochs=EPOCHS, verbose=0)
    total = 2 * EPOCHS * (ROWS // BATCH)
    # Wait for the other worker: then both read the same shared variables.
    deadline = time.monotonic() + 120
    while int(model.optimizer.iterations.numpy()) < total and time.monotonic() < deadline:
        time.sleep(0.1)
    return {
        "task": os.environ["TF_CONFIG"],
        "between_graph": extended.experimental_between_graph,
        "should_checkpoint": extended.should_checkpoint,
        "iterations": int(model.optimizer.iterations.numpy()),
        "before": float(before),
        "after": float(model.evaluate(x, y, verbose=0)),
        "losses": history.history["loss"],
        "weights": [w.tolist() for w in model.get_weights()],
    }


def test_two_workers_train_shared_variables_between_graph():
    cluster = testing.create_cluster_spec(num_workers=2, num_ps=1)
    runner = testing.MultiProcessRunner(
        _between_graph_task,
        cluster,
        env={"KERAS_DIST_CLUSTER_TOKEN": "between-graph-test"},
        stream_output=False,
        dependence_on_chief=False,
    )
    with runner:
        runner.start()
        deadline = time.monotonic() + 200
        while time.monotonic() < deadline:
            states = {key: s.state for key, s in runner.process_status().items()}
            workers = [states[("worker", 0)], states[("worker", 1)]]
            if all(state != "running" for state in workers):
                break
            time.sleep(0.2)
        # The job ends when its workers do: then the ps task is stopped, as launchers do.
        runner.terminate("ps", 0)
        results = runner.join(timeout=60)
    workers = [r for r in results if r is not None]
    assert len(workers) == 2, results
    total = 2 * EPOCHS * (ROWS // BATCH)
    for result in workers:
        assert result["between_graph"]
        assert result["iterations"] == total
        assert result["after"] < 0.2 * result["before"]
        assert result["losses"][-1] < result["losses"][0]
    assert [w["should_checkpoint"] for w in workers] == [True, False]
    for a, b in zip(workers[0]["weights"], workers[1]["weights"]):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
