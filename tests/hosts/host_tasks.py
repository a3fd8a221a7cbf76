"""What the tasks on hosts of their own run: ``python host_tasks.py ROLE OUT_DIR``.

Each task finds its place in ``TF_CONFIG`` and writes what the test checks to
``OUT_DIR`` (``<task>.json``, ``<task>.npz``); files named ``*.mark`` signal between
the tasks and the test, which runs on no host (the hosts reach only each other).
"""

import json
import os
import pathlib
import sys
import time

import numpy as np


def _task():
    task = json.loads(os.environ["TF_CONFIG"])["task"]
    return f"{task['type']}{task['index']}"


def _write_json(out, name, value):
    # Written whole, then renamed: the test never reads half a file.
    partial = out / f"{name}.partial"
    partial.write_text(json.dumps(value))
    partial.rename(out / f"{name}.json")


def tiny_model():
    import keras

    model = keras.Sequential(
        [keras.Input((3,)), keras.layers.Dense(4, activation="relu"), keras.layers.Dense(1)]
    )
    model.compile(optimizer=keras.optimizers.SGD(0.1, momentum=0.5), loss="mse")
    return model


def regression_data(rows):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(rows, 3)).astype("float32")
    return x, x.sum(axis=1, keepdims=True)


def flat(weights):
    return np.concatenate([np.ravel(w) for w in weights])


# ------------------------------------------------------------------------ MWMS: fit
FIT_ROWS, FIT_BATCH, FIT_EPOCHS = 96, 24, 2  # 8 rows a worker a step, 4 steps an epoch


def mwms_fit(out):
    import keras

    import keras_dist as kd

    strategy = kd.MultiWorkerMirroredStrategy()
    task_id = strategy.cluster_resolver.task_id
    keras.utils.set_random_seed(task_id)  # each worker initializes differently...
    with strategy.scope():
        model = tiny_model()
    initial = flat(model.get_weights())  # ...and reads worker 0's first values
    x, y = regression_data(FIT_ROWS)
    history = model.fit(x, y, batch_size=FIT_BATCH, epochs=FIT_EPOCHS, shuffle=False, verbose=0)
    np.savez(out / f"{_task()}.npz", initial=initial, final=flat(model.get_weights()))
    _write_json(out, _task(), {"loss": history.history["loss"], "socket": _gloo_hostname()})


def _gloo_hostname():
    import socket

    return [socket.gethostname(), socket.gethostbyname(socket.gethostname())]


# ------------------------------------------------------------ MWMS: a link cut mid-fit
def _pace(out, task):
    """A callback: says when batch 3 ended (``<task>-batch3.mark``), records when each
    batch ended (``batch_ends``), and paces the steps (0.1 s) so that a cut falls mid-fit."""
    import keras

    class Pace(keras.callbacks.Callback):
        def __init__(self):
            super().__init__()
            self.batch_ends = []

        def on_train_batch_end(self, batch, logs=None):
            self.batch_ends.append(time.time())
            if batch == 3:
                (out / f"{task}-batch3.mark").touch()
            time.sleep(0.1)

    return Pace()


CUT_FIT_ROWS = FIT_ROWS * 15  # 60 steps: 0.1 s apart, and a link cut for a few seconds


def mwms_fit_through_a_cut(out, timeout_seconds):
    """``mwms_fit`` (60 steps, one epoch) paced so that a link can be cut and restored mid-fit.

    Writes the first and last weights (``<task>.npz``), and the error (if any), when
    ``fit`` ended and when each batch ended (``<task>.json``).
    """
    import keras

    import keras_dist as kd

    strategy = kd.MultiWorkerMirroredStrategy(
        communication_options=kd.experimental.CommunicationOptions(timeout_seconds=timeout_seconds)
    )
    task = _task()
    keras.utils.set_random_seed(strategy.cluster_resolver.task_id)
    with strategy.scope():
        model = tiny_model()
    initial = flat(model.get_weights())
    x, y = regression_data(CUT_FIT_ROWS)
    pace = _pace(out, task)
    result = {"error": None}
    try:
        history = model.fit(
            x, y, batch_size=FIT_BATCH, epochs=1, shuffle=False, verbose=0, callbacks=[pace]
        )
        np.savez(out / f"{task}.npz", initial=initial, final=flat(model.get_weights()))
        result["loss"] = history.history["loss"]
    except BaseException as error:
        result = {"error": type(error).__name__, "message": str(error)}
        raise
    finally:
        _write_json(out, task, {**result, "time": time.time(), "batch_ends": pace.batch_ends})


def mwms_lose_link(out, timeout_seconds):
    import keras

    import keras_dist as kd

    strategy = kd.MultiWorkerMirroredStrategy(
        communication_options=kd.experimental.CommunicationOptions(timeout_seconds=timeout_seconds)
    )
    task = _task()
    with strategy.scope():
        model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
        model.compile(optimizer="sgd", loss="mse")
    x, y = np.ones((24 * 400, 3), "float32"), np.ones((24 * 400, 1), "float32")
    try:
        model.fit(x, y, batch_size=24, epochs=1, verbose=0, callbacks=[_pace(out, task)])
    except BaseException as error:
        _write_json(
            out,
            task,
            {"error": type(error).__name__, "message": str(error), "time": time.time()},
        )
        raise
    _write_json(out, task, {"error": None, "time": time.time()})


# --------------------------------------------------------- parameter servers: a ps cut
def ps_server(out):
    import keras_dist as kd

    resolver = kd.cluster_resolver.TFConfigClusterResolver()
    kd.Server(resolver, job_name=resolver.task_type, task_index=resolver.task_id).join()


PACE = 0.1  # seconds between two closures scheduled while the test cuts a link
PACED_AT_MOST = 1200  # closures: 120 s of pacing, past every bound of the tests


def ps_chief(out, started, after):
    """Schedules increments of a counter on the ps task: a link can be cut mid-run.

    ``started`` closures first (then says so, ``started.json``), then one every
    ``PACE`` seconds until the test says the link is back (``restored.mark``), then
    ``after`` more, and joins. Writes the error ``schedule``/``join`` raised (if any),
    when it ended and how many closures were scheduled (``chief0.json``), then the
    counter (``counter.json``).
    """
    import jax.numpy as jnp
    import keras

    import keras_dist as kd

    strategy = kd.ParameterServerStrategy(kd.cluster_resolver.TFConfigClusterResolver())
    coordinator = kd.coordinator.ClusterCoordinator(strategy)
    with strategy.scope():
        counter = keras.Variable(0.0)

    def increment(counter):
        x = jnp.ones((128, 128)) / 128.0
        for _ in range(20):
            x = jnp.tanh(x @ x + 1.0)
        counter.assign_add(1.0)
        return jnp.sum(x)

    for _ in range(started):
        coordinator.schedule(increment, args=(counter,))
    coordinator.join()
    _write_json(out, "started", {"time": time.time(), "counter": float(counter.numpy())})
    result, scheduled = {"error": None}, started
    try:
        while not (out / "restored.mark").exists() and scheduled < started + PACED_AT_MOST:
            coordinator.schedule(increment, args=(counter,))
            scheduled += 1
            time.sleep(PACE)
        for _ in range(after):
            coordinator.schedule(increment, args=(counter,))
            scheduled += 1
        coordinator.join()
    except BaseException as error:
        result = {"error": type(error).__name__, "message": str(error)}
    result.update(join_ended=time.time(), scheduled=scheduled)
    _write_json(out, "chief0", result)
    try:  # after an error, what the ps holds once the link is back
        counted = {"counter": float(counter.numpy())}
    except BaseException as error:
        counted = {"error": f"{type(error).__name__}: {error}"}
    _write_json(out, "counter", counted)


if __name__ == "__main__":
    role, directory, *rest = sys.argv[1:]
    globals()[role](pathlib.Path(directory), *map(int, rest))
