"""MultiWorkerMirroredStrategy across real local processes (TF_CONFIG, 127.0.0.1 ports).

Each test starts a small cluster with ``kd.launch`` or ``kd.testing.MultiProcessRunner``;
the functions below run in the worker processes and return what the test checks.
Expected values are TF's (its collective_all_reduce_strategy, input and multi-worker Keras
tests) or a single device's.
"""

import contextlib

import numpy as np
import pytest

import keras_dist as kd
from keras_dist import testing

pytestmark = pytest.mark.multiprocess

TIMEOUT = 180  # seconds per cluster; a hang fails the test with every worker's log


def _launch(fn, num_workers=2, devices=1, **kwargs):
    return kd.launch(
        fn,
        num_workers=num_workers,
        devices_per_worker=devices,
        timeout=TIMEOUT,
        stream_output=False,
        **kwargs,
    )


def _local(strategy, value):
    return [np.asarray(c).tolist() for c in strategy.experimental_local_results(value)]


# --------------------------------------------------------------------------- collectives
def _collectives_worker():
    strategy = kd.MultiWorkerMirroredStrategy()
    import jax.numpy as jnp

    extended = strategy.extended
    host = 1.0
    ids = strategy.run(lambda: kd.get_replica_context().replica_id_in_sync_group)
    ones = strategy.run(lambda: jnp.ones(()))

    def all_reduce_step(x):
        return kd.get_replica_context().all_reduce("SUM", x * 2.0)

    values = strategy.experimental_distribute_values_from_function(
        lambda context: np.float32(context.replica_id_in_sync_group)
    )
    return {
        "replicas": strategy.num_replicas_in_sync,
        "task": (strategy.cluster_resolver.task_type, strategy.cluster_resolver.task_id),
        "should_checkpoint": extended.should_checkpoint,
        # Spec 16: a host value v=1 is each worker's own.
        "reduce_host": float(strategy.reduce("SUM", host, axis=None)),
        "reduce_to_host": float(np.asarray(extended.reduce_to("SUM", host, host))),
        "batch_reduce_host": [
            float(np.asarray(x)) for x in extended.batch_reduce_to("SUM", [(host, host)] * 2)
        ],
        # ... and device values from run give the same.
        "reduce_run": float(strategy.reduce("SUM", ones, axis=None)),
        "batch_reduce_run": [
            float(np.asarray(x.values[0]))
            for x in extended.batch_reduce_to("SUM", [(ones, ones)] * 2)
        ],
        "ids": _local(strategy, ids),
        "sum_ids": float(strategy.reduce("SUM", ids, axis=None)),
        "mean_ids": float(strategy.reduce("MEAN", ids, axis=None)),
        "all_reduce": _local(strategy, strategy.run(all_reduce_step, args=(values,))),
        "gather": np.asarray(
            strategy.gather(strategy.run(lambda: jnp.full((2,), ids_of_replica())), axis=0)
        ).tolist(),
        "gather_host": np.asarray(
            strategy.gather(np.array([strategy.cluster_resolver.task_id]), axis=0)
        ).tolist(),
    }


def ids_of_replica():
    return kd.get_replica_context().replica_id_in_sync_group


def test_reduce_run_and_gather_on_two_workers_match_tf():
    chief, worker = _launch(_collectives_worker)
    for result in (chief, worker):
        assert result["replicas"] == 2
        assert result["reduce_host"] == 2.0
        assert result["reduce_to_host"] == 2.0
        assert result["batch_reduce_host"] == [2.0, 2.0]
        assert result["reduce_run"] == 2.0
        assert result["batch_reduce_run"] == [2.0, 2.0]
        # Replica ids are int32: across workers MEAN divides as integers, as TF does.
        assert result["sum_ids"] == 1.0 and result["mean_ids"] == 0.0
        assert result["gather"] == [0, 0, 1, 1]
        assert result["gather_host"] == [0, 1]  # a host value is each worker's own
        assert result["all_reduce"] == [2.0]  # 2 * (0 + 1)
    assert (chief["task"], worker["task"]) == (("worker", 0), ("worker", 1))
    assert (chief["ids"], worker["ids"]) == ([0], [1])
    assert (chief["should_checkpoint"], worker["should_checkpoint"]) == (True, False)


def _two_devices_each_worker(steps):
    strategy = kd.MultiWorkerMirroredStrategy()

    def step(x):
        return kd.get_replica_context().all_reduce("SUM", x * 2.0)

    values = strategy.experimental_distribute_values_from_function(
        lambda context: np.float32(context.replica_id_in_sync_group)
    )
    for _ in range(steps):  # overlapping collectives hung across processes (docs/architecture.md)
        out = strategy.run(step, args=(values,))
    batches = strategy.experimental_distribute_dataset(_numpy(np.arange(15), 4))
    return {
        "ids": _local(strategy, strategy.run(ids_of_replica)),
        "sum_of_ones": float(strategy.reduce("SUM", strategy.run(lambda: 1.0), axis=None)),
        "stress": _local(strategy, out),
        "last_batch": [_local(strategy, b) for b in batches][-1],
    }


@pytest.mark.stress
def test_two_workers_with_two_devices_each_run_2000_collective_steps():
    first, second = _launch(_two_devices_each_worker, devices=2, args=(2000,))
    assert (first["ids"], second["ids"]) == ([0, 1], [2, 3])
    assert first["sum_of_ones"] == second["sum_of_ones"] == 4.0
    assert first["stress"] == second["stress"] == [12.0, 12.0]  # 2 * (0 + 1 + 2 + 3)
    # Spec 51, 2x2 with range(15).batch(4): worker 0 ends [[12], [14]], worker 1 [[13], []].
    assert first["last_batch"] == [[12], [14]]
    assert second["last_batch"] == [[13], []]


# --------------------------------------------------------------------------------- input
def _numpy(values, batch_size, drop_remainder=False):
    from keras_dist._input import NumpyDataset

    return NumpyDataset(values).batch(batch_size, drop_remainder=drop_remainder)


def _input_worker():
    strategy = kd.MultiWorkerMirroredStrategy()

    def steps(dataset):
        return [_local(strategy, batch) for batch in dataset]

    def by_function(dataset_fn):
        return steps(strategy.distribute_datasets_from_function(dataset_fn))

    def data_sharded(values, batch_size):
        return lambda context: kd.data.auto_shard(
            kd.data.with_auto_shard_policy(_numpy(values, batch_size(context)), "DATA"), context
        )

    distribute = strategy.experimental_distribute_dataset
    files = kd.data.FileDataset(["a", "b"], reader=lambda path: [path])
    try:
        distribute(kd.data.with_auto_shard_policy(files, "FILE"))
        file_policy = "accepted"
    except ValueError as error:
        file_policy = str(error)
    return {
        "file_policy": file_policy,
        "50_global": steps(distribute(_numpy(np.arange(14), 8))),
        "50_function": by_function(
            data_sharded(np.arange(14), lambda c: c.get_per_replica_batch_size(8))
        ),
        "50_shard_sums": [
            sum(step[0]) for step in by_function(data_sharded(np.arange(10), lambda c: 5))
        ][:1],
        "51": steps(distribute(_numpy(np.arange(9), 2))),
        "51_drop": steps(distribute(_numpy(np.arange(9), 2, drop_remainder=True))),
        "52_auto": steps(distribute(_numpy(np.arange(4), 2))),
        "52_off": steps(
            distribute(kd.data.with_auto_shard_policy(_numpy(np.arange(12), 8), "OFF"))
        ),
        "52_data": steps(
            distribute(kd.data.with_auto_shard_policy(_numpy(np.arange(8), 3), "DATA"))
        ),
        "53": by_function(lambda context: _numpy(np.arange(8 + context.input_pipeline_id), 2)),
        "scalars": by_function(
            lambda context: [
                np.int32(10 * context.input_pipeline_id + i)
                for i in range(3 + 2 * context.input_pipeline_id)
            ]
        ),
    }


def test_input_pipelines_across_two_workers_match_tf():
    chief, worker = _launch(_input_worker)
    # Spec 50: range(14).batch(8), second step chief [8, 9, 10] and worker [11, 12, 13];
    # from a function (per-replica 4, then shard) chief [8..11] and worker [12, 13];
    # batch(5).shard: first-step sums chief 10, worker 35.
    assert chief["50_global"] == [[[0, 1, 2, 3]], [[8, 9, 10]]]
    assert worker["50_global"] == [[[4, 5, 6, 7]], [[11, 12, 13]]]
    assert chief["50_function"][1] == [[8, 9, 10, 11]]
    assert worker["50_function"][1] == [[12, 13]]
    assert (chief["50_shard_sums"], worker["50_shard_sums"]) == ([10], [35])
    # Spec 51: range(9).batch(2); drop_remainder keeps 4 steps.
    assert chief["51"] == [[[0]], [[2]], [[4]], [[6]], [[8]]]
    assert worker["51"] == [[[1]], [[3]], [[5]], [[7]], [[]]]
    assert len(chief["51_drop"]) == len(worker["51_drop"]) == 4
    # Spec 52: AUTO shards; OFF gives every worker everything; DATA with range(8).batch(3).
    assert (chief["52_auto"], worker["52_auto"]) == ([[[0]], [[2]]], [[[1]], [[3]]])
    assert chief["52_off"] == worker["52_off"] == [[[0, 1, 2, 3]], [[4, 5, 6, 7]], [[8, 9, 10, 11]]]
    assert chief["52_data"] == [[[0, 1]], [[3, 4]], [[6]]]
    assert worker["52_data"] == [[[2]], [[5]], [[7]]]
    # Spec 53: pipelines of range(8) and range(9), batch 2: the last step is [[]] and [[8]].
    assert (chief["53"][-1], worker["53"][-1]) == ([[]], [[8]])
    assert len(chief["53"]) == len(worker["53"]) == 5
    # Unbatched scalars (3 on the chief, 5 on the worker) have no empty batch: the input
    # ends for both workers at the first step that one of them has no element for.
    assert (chief["scalars"], worker["scalars"]) == ([[0], [1], [2]], [[10], [11], [12]])
    # FILE is applied in a dataset_fn; the message says so (it said "Batch the dataset
    # first", which would drop the policy).
    assert "kd.data.auto_shard(dataset, input_context)" in chief["file_policy"]


# ------------------------------------------------------------------------------ failures
def _loses_worker_1(how, timeout_seconds, loop="fit"):
    import os
    import time

    strategy = kd.MultiWorkerMirroredStrategy(
        communication_options=kd.experimental.CommunicationOptions(timeout_seconds=timeout_seconds)
    )
    import keras

    task_id = strategy.cluster_resolver.task_id

    class LoseWorker1(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            if task_id == 1 and batch == 5:
                if how == "dies":
                    os._exit(17)
                if how == "stopped":
                    import signal

                    os.kill(os.getpid(), signal.SIGSTOP)  # frozen whole, as `kill -STOP`
                time.sleep(3600)  # stuck outside the collective

    with strategy.scope():
        model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
        model.compile(optimizer="sgd", loss="mse")
    x, y = np.ones((640, 3), "float32"), np.ones((640, 1), "float32")

    class LosingWorker1(keras.utils.PyDataset):
        """Batches of 16; worker 1 is lost reading the sixth: no callback runs per batch."""

        def __len__(self):
            return 40

        def __getitem__(self, index):
            if index == 5:
                LoseWorker1().on_train_batch_end(5)
            return x[index * 16 : (index + 1) * 16], y[index * 16 : (index + 1) * 16]

    start = time.monotonic()
    try:
        if loop == "fit":
            model.fit(x, y, batch_size=16, epochs=3, verbose=0, callbacks=[LoseWorker1()])
        elif loop in ("quiet fit", "progress bar fit"):
            # Nothing between two steps: each step still runs when fit reads the next
            # batch (and, with the progress bar, Keras reads its loss directly).
            model.fit(LosingWorker1(), epochs=3, verbose=int(loop == "progress bar fit"))
        else:
            _custom_loop(strategy, model, x, y, LoseWorker1())
    except kd.errors.OpError as error:
        print(f"SURVIVOR {type(error).__name__} after {time.monotonic() - start:.1f} s: {error}")
        raise
    return "finished"


def _custom_loop(strategy, model, x, y, callback):
    """TF's custom loop: a ``kd.function`` step around ``strategy.run``."""
    import keras

    loss_fn = keras.losses.MeanSquaredError(reduction=None)

    @kd.function
    def step(batch):
        def replica_step(inputs, targets):
            def loss():
                return kd.nn.compute_average_loss(loss_fn(targets, model(inputs)))

            value, grads = kd.value_and_grad(loss, model.trainable_variables)()
            model.optimizer.apply_gradients(zip(grads, model.trainable_variables))
            return value

        return strategy.reduce("SUM", strategy.run(replica_step, args=batch), axis=None)

    batches = strategy.experimental_distribute_dataset(
        [(x[i : i + 16], y[i : i + 16]) for i in range(0, len(x), 16)]
    )
    for index, batch in enumerate(batches):
        step(batch)
        callback.on_train_batch_end(index)


def _run_losing_worker_1(how, timeout_seconds, loop="fit"):
    cluster = testing.create_cluster_spec(num_workers=2)
    with testing.MultiProcessRunner(
        _loses_worker_1,
        cluster,
        args=(how, timeout_seconds, loop),
        devices_per_worker=1,
        stream_output=False,
        dependence_on_chief=False,
        # A worker that dies first leaves the survivor its whole timeout to name it; a
        # stuck or frozen worker never exits by itself, and the survivor fails first.
        failure_grace=timeout_seconds + 30 if how == "dies" else 5,
        terminate_grace=2,
    ) as runner:
        runner.start()
        # The first failure is raised: the lost task's exit or the survivor's error.
        with pytest.raises((testing.UnexpectedSubprocessExitError, testing.WorkerError)):
            runner.join(timeout=TIMEOUT)
        survivor = runner.logs("worker", 0)
        return survivor, runner.exit_code("worker", 0), runner.exit_code("worker", 1)


def _seconds_until_error(log):
    line = next(line for line in log.splitlines() if line.startswith("SURVIVOR"))
    return float(line.split(" after ")[1].split(" s:")[0])


@pytest.mark.parametrize("loop", ["fit", "quiet fit"])
def test_a_killed_worker_makes_the_survivor_raise_naming_it(loop):
    # Spec 68: the survivor raises UnavailableError within 60 s, and exits.
    log, survivor_code, lost_code = _run_losing_worker_1("dies", timeout_seconds=60, loop=loop)
    assert lost_code == 17
    assert "SURVIVOR UnavailableError" in log, log
    assert "Lost contact with worker 1" in log
    assert _seconds_until_error(log) < 60
    assert survivor_code == 1


@pytest.mark.parametrize("loop", ["fit", "kd.function", "quiet fit"])
def test_a_stuck_worker_makes_the_survivor_raise_deadline_exceeded(loop):
    log, survivor_code, _ = _run_losing_worker_1("hangs", timeout_seconds=8, loop=loop)
    assert "SURVIVOR DeadlineExceededError" in log, log
    assert "within 8 s: worker 1 did not reach it" in log
    assert 8 <= _seconds_until_error(log) < 30
    assert survivor_code == 1


def test_a_survivor_reading_a_running_steps_loss_still_names_a_stuck_worker():
    # With the progress bar, Keras may read a step's loss while the step waits for the
    # stuck worker, outside keras_dist's wait: the watchdog names it and ends the process.
    log, survivor_code, _ = _run_losing_worker_1("hangs", 8, loop="progress bar fit")
    assert "DeadlineExceededError" in log, log
    assert "within 8 s: worker 1 did not reach it" in log
    assert survivor_code == 1


_BLOCKED_OUTSIDE_THE_WAIT = """
import jax, numpy as np
from keras_dist._peer_watch import PeerWatch

# A step whose collective never completes: a program that never ends (dispatched
# asynchronously, as a multi-process step is: a matmul in it).
m = np.eye(64, dtype=np.float32)
program = jax.jit(
    lambda x: jax.lax.while_loop(lambda x: x[0, 0] > -2.0, lambda x: jax.numpy.sin(x @ m), x)
)
watch = PeerWatch(["worker 0", "worker 1"], 0, timeout_seconds=1)
out, pending = watch.dispatch(program, np.ones((64, 64), np.float32), run_on=True)
print("dispatched", flush=True)
np.asarray(out)  # a direct read: no deadline of its own
print("read", flush=True)
"""


def test_the_watchdog_ends_a_process_blocked_outside_the_wait():
    import subprocess
    import sys
    import time

    start = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-c", _BLOCKED_OUTSIDE_THE_WAIT],
        capture_output=True,
        text=True,
        timeout=90,
    )
    assert done.returncode == 1, done.stderr
    assert done.stdout == "dispatched\n"
    assert "DeadlineExceededError: A collective did not complete within 1 s" in done.stderr
    assert "worker 1 did not reach it" in done.stderr
    assert time.monotonic() - start < 60


def test_a_sigstopped_worker_makes_the_survivor_raise_within_the_timeout():
    # A frozen process (SIGSTOP: no thread of it runs, its heartbeats stop too) is
    # named like a stuck one, within the configured timeout, and the survivor exits.
    log, survivor_code, _ = _run_losing_worker_1("stopped", timeout_seconds=8)
    assert "SURVIVOR DeadlineExceededError" in log or "SURVIVOR UnavailableError" in log, log
    assert "worker 1" in log
    assert _seconds_until_error(log) < 30
    assert survivor_code == 1


# ------------------------------------------------------------------------------- training
def _tiny_model():
    import keras

    model = keras.Sequential(
        [keras.Input((3,)), keras.layers.Dense(4, activation="relu"), keras.layers.Dense(1)]
    )
    model.compile(optimizer=keras.optimizers.SGD(0.1, momentum=0.5), loss="mse", metrics=["mae"])
    return model


def _tiny_model_from(flat_weights):
    """``_tiny_model`` on one device with the weights ``_flat`` gave ``flat_weights``."""
    model = _tiny_model()
    shapes = [w.shape for w in model.get_weights()]
    split = np.split(flat_weights, np.cumsum([int(np.prod(s)) for s in shapes])[:-1])
    model.set_weights([w.reshape(s) for w, s in zip(split, shapes)])
    return model


def _regression_data(rows):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(rows, 3)).astype("float32")
    return x, x.sum(axis=1, keepdims=True)


def _flat(weights):
    return np.concatenate([np.ravel(w) for w in weights])


def _fit_worker(directory):
    strategy = kd.MultiWorkerMirroredStrategy()
    import keras

    task_id = strategy.cluster_resolver.task_id
    keras.utils.set_random_seed(task_id)  # each worker initializes differently...
    with strategy.scope():
        model = _tiny_model()
    initial = _flat(model.get_weights())  # ...and reads worker 0's first values
    x, y = _regression_data(69)  # 69 = 4 x 16 + 5: a last batch split 3 / 2
    # Keras's own callback, as a port of tf.keras code passes it: the chief's file alone
    # stays (every worker wrote the same path, and the file came out corrupt).
    keras_checkpoint = keras.callbacks.ModelCheckpoint(f"{directory}/ckpt/model.keras")
    history = model.fit(
        x,
        y,
        batch_size=16,
        epochs=2,
        shuffle=False,
        verbose=0,
        callbacks=[
            keras_checkpoint,
            kd.callbacks.ModelCheckpoint(
                f"{directory}/ckpt/model.weights.h5", save_weights_only=True
            ),
            kd.callbacks.TensorBoard(f"{directory}/logs"),
        ],
    )
    return {
        "initial": initial,
        "final": _flat(model.get_weights()),
        "history": history.history,
        "evaluate": model.evaluate(x, y, batch_size=16, verbose=0),
        "predict": model.predict(x[:10], batch_size=4, verbose=0),
        "chief_only_checkpoint": isinstance(keras_checkpoint, kd.callbacks.ModelCheckpoint),
    }


def test_fit_on_two_workers_equals_one_device_and_checkpoints_once(tmp_path):
    import os

    import keras

    chief, worker = _launch(_fit_worker, args=(str(tmp_path),))
    np.testing.assert_array_equal(chief["initial"], worker["initial"])
    np.testing.assert_array_equal(chief["final"], worker["final"])
    # One device from the same first weights on the same global batches (spec 82's harness).
    model = _tiny_model_from(chief["initial"])
    x, y = _regression_data(69)
    history = model.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0)
    np.testing.assert_allclose(chief["final"], _flat(model.get_weights()), atol=1e-5)
    for key, values in history.history.items():
        np.testing.assert_allclose(chief["history"][key], values, rtol=1e-5)
        np.testing.assert_allclose(worker["history"][key], values, rtol=1e-5)
    expected_eval = model.evaluate(x, y, batch_size=16, verbose=0)
    np.testing.assert_allclose(chief["evaluate"], expected_eval, rtol=1e-5)
    np.testing.assert_allclose(worker["predict"], model.predict(x[:10], verbose=0), atol=1e-5)
    assert chief["chief_only_checkpoint"] and worker["chief_only_checkpoint"]
    # Spec 66: the checkpoints exist once, written by the chief; no temp dir is left.
    assert sorted(os.listdir(tmp_path / "ckpt")) == ["model.keras", "model.weights.h5"]
    restored = keras.models.load_model(tmp_path / "ckpt" / "model.keras")
    np.testing.assert_allclose(_flat(restored.get_weights()), chief["final"])
    # TensorBoard writes only on the chief.
    assert sorted(os.listdir(tmp_path / "logs")) == ["train"]


def _fit_beside_another_model_worker():
    strategy = kd.MultiWorkerMirroredStrategy()
    import keras

    keras.utils.set_random_seed(0)
    with strategy.scope():
        model = _tiny_model()
    initial = _flat(model.get_weights())
    x, y = _regression_data(64)
    model.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0)
    with strategy.scope():
        other = _tiny_model()  # variables created after `model`'s steps were compiled
    other.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0)
    programs = {id(entry) for entry in strategy.extended._compiled._cache.values()}
    history = model.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0)
    after = {id(entry) for entry in strategy.extended._compiled._cache.values()}
    return {
        "initial": initial,
        "final": _flat(model.get_weights()),
        "loss": history.history["loss"],
        "new_programs": len(after - programs),
    }


def test_fit_after_another_model_on_two_workers_keeps_its_programs_and_numbers():
    chief, worker = _launch(_fit_beside_another_model_worker)
    assert chief["new_programs"] == worker["new_programs"] == 0
    np.testing.assert_array_equal(chief["final"], worker["final"])
    model = _tiny_model_from(chief["initial"])  # one device, the same first weights
    x, y = _regression_data(64)
    history = model.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0)
    np.testing.assert_allclose(chief["final"], _flat(model.get_weights()), atol=1e-5)
    np.testing.assert_allclose(chief["loss"], history.history["loss"][1:], rtol=1e-5)


def _endless_batches(rows):
    """A generator of ``rows``-row batches cycling through 64 regression rows (TF's repeat)."""
    x, y = _regression_data(64)
    start = 0
    while True:
        index = np.arange(start, start + rows) % 64
        yield x[index], y[index]
        start += rows


def _batches_of(rows):
    """The 64 regression rows as a finite ``PyDataset`` of ``rows``-row batches."""
    import keras

    x, y = _regression_data(64)

    class Batches(keras.utils.PyDataset):
        def __len__(self):
            return 64 // rows

        def __getitem__(self, i):
            return x[i * rows : (i + 1) * rows], y[i * rows : (i + 1) * rows]

    return Batches()


def _fit_with_policies_worker():
    strategy = kd.MultiWorkerMirroredStrategy()
    import keras

    keras.utils.set_random_seed(0)
    initial = _tiny_model().get_weights()
    results = {"initial": _flat(initial)}
    for policy in ("OFF", "DATA", None, "OFF of a PyDataset"):
        with strategy.scope():
            model = _tiny_model()  # a fresh optimizer: no momentum from the last run
        model.set_weights(initial)
        if policy == "OFF of a PyDataset":
            # A finite dataset, one pass an epoch (4 batches of 16: 8 pieces of 8).
            data = kd.data.with_auto_shard_policy(_batches_of(16), "OFF")
            history = model.fit(data, epochs=3, steps_per_epoch=8, shuffle=False, verbose=0)
            results[policy] = (history.history["loss"], _flat(model.get_weights()))
            continue
        data = _endless_batches(16)
        if policy is not None:
            data = kd.data.with_auto_shard_policy(data, policy)
        history = model.fit(data, epochs=2, steps_per_epoch=3, verbose=0)
        results[policy] = (history.history["loss"], _flat(model.get_weights()))
    return results


def test_fit_takes_auto_shard_policies_and_off_has_every_worker_read_all():
    # TF: with AutoShardPolicy.OFF both workers read all of the data, each global batch of
    # 16 is rebatched into pieces of 8 and each worker's replica takes them in turn: both
    # train on the same 8 rows each step, as one device does on batches of 8 (the tutorial's
    # numbers matched TF 2.21 this way). DATA is fit's own split of each global batch.
    chief, worker = _launch(_fit_with_policies_worker)
    np.testing.assert_array_equal(chief["OFF"][1], worker["OFF"][1])
    for policy, rows in (("OFF", 8), ("DATA", 16)):
        model = _tiny_model_from(chief["initial"])
        history = model.fit(_endless_batches(rows), epochs=2, steps_per_epoch=3, verbose=0)
        np.testing.assert_allclose(chief[policy][0], history.history["loss"], rtol=1e-5)
        np.testing.assert_allclose(chief[policy][1], _flat(model.get_weights()), atol=1e-5)
    np.testing.assert_array_equal(chief["DATA"][1], chief[None][1])  # the default split
    # A finite PyDataset under OFF with a full pass an epoch: every epoch trains its 8
    # steps (the second used to find the data used up and log a loss of 0.0), as one
    # device does on the 8 batches of 8 rows each epoch.
    model = _tiny_model_from(chief["initial"])
    history = model.fit(_batches_of(8), epochs=3, shuffle=False, verbose=0)
    losses, weights = chief["OFF of a PyDataset"]
    np.testing.assert_allclose(losses, history.history["loss"], rtol=1e-5)
    np.testing.assert_allclose(weights, _flat(model.get_weights()), atol=1e-5)


def _loop_with_a_partial_batch(strategy, initial=None):
    """TF's custom loop with a metric; the last batch (69 = 4 x 16 + 5) splits 3 / 2."""
    import keras

    with strategy.scope():
        model = _tiny_model()
        mean_loss = keras.metrics.Mean()
    if initial is not None:
        shapes = [w.shape for w in model.get_weights()]
        pieces = np.split(initial, np.cumsum([int(np.prod(s)) for s in shapes])[:-1])
        model.set_weights([w.reshape(s) for w, s in zip(pieces, shapes)])
    loss_fn = keras.losses.MeanSquaredError(reduction=None)

    def replica_step(inputs, targets):
        def loss():
            per_example = loss_fn(targets, model(inputs, training=True))
            mean_loss.update_state(per_example)
            return kd.nn.compute_average_loss(per_example, global_batch_size=16)

        value, grads = kd.value_and_grad(loss, model.trainable_variables)()
        model.optimizer.apply_gradients(zip(grads, model.trainable_variables))
        return value

    @kd.function
    def step(batch):
        return strategy.reduce("SUM", strategy.run(replica_step, args=batch), axis=None)

    x, y = _regression_data(69)
    batches = [(x[i : i + 16], y[i : i + 16]) for i in range(0, 69, 16)]
    losses = [float(step(b)) for b in strategy.experimental_distribute_dataset(batches)]
    return {
        "initial": initial,
        "losses": losses,
        "final": _flat(model.get_weights()),
        "mean_loss": float(mean_loss.result()),
        "iterations": int(model.optimizer.iterations.numpy()),
    }


def _partial_batch_worker():
    strategy = kd.MultiWorkerMirroredStrategy()
    with strategy.scope():
        initial = _flat(_tiny_model().get_weights())  # worker 0's first values, everywhere
    result = _loop_with_a_partial_batch(strategy, initial)
    result["uneven_traces"] = strategy.extended._uneven.trace_count
    return result


def test_custom_loop_partial_batch_across_workers_is_compiled_and_equals_one_device():
    chief, worker = _launch(_partial_batch_worker)
    # The last batch ran as one compiled program on every worker (not replica threads
    # op by op, with a collective for each reduction), traced once.
    assert chief["uneven_traces"] == worker["uneven_traces"] == 1
    expected = _loop_with_a_partial_batch(kd.get_strategy(), chief["initial"])
    for result in (chief, worker):
        np.testing.assert_allclose(result["losses"], expected["losses"], rtol=1e-5)
        np.testing.assert_allclose(result["final"], expected["final"], atol=1e-6)
        np.testing.assert_allclose(result["mean_loss"], expected["mean_loss"], rtol=1e-5)
        assert result["iterations"] == expected["iterations"] == 5


def _resumable_worker(directory, fail_at_batch, marker, preemptible=False):
    import os
    import time

    strategy = kd.MultiWorkerMirroredStrategy(
        communication_options=kd.experimental.CommunicationOptions(timeout_seconds=60)
    )
    import keras

    task_id = strategy.cluster_resolver.task_id

    class LoseWorker1Once(keras.callbacks.Callback):
        def __init__(self):
            super().__init__()
            self.seen = 0

        def on_train_batch_end(self, batch, logs=None):
            self.seen += 1
            if task_id == 1 and self.seen == fail_at_batch and not os.path.exists(marker):
                open(marker, "w").close()
                if not preemptible:
                    import signal

                    os.kill(os.getpid(), signal.SIGKILL)  # killed mid-epoch, once
            if preemptible and os.path.exists(marker):
                time.sleep(0.2)  # leaves the test time to send SIGTERM mid-fit

    keras.utils.set_random_seed(task_id + 10)
    with strategy.scope():
        model = _tiny_model()
    x, y = _regression_data(160)
    callbacks = [
        kd.callbacks.BackupAndRestore(
            f"{directory}/backup", save_freq=3, save_before_preemption=preemptible
        )
    ]
    if fail_at_batch:
        callbacks.append(LoseWorker1Once())
    model.fit(x, y, batch_size=16, epochs=3, verbose=0, callbacks=callbacks)
    return _flat(model.get_weights())


@pytest.fixture(scope="module")
def uninterrupted_weights(tmp_path_factory):
    directory = tmp_path_factory.mktemp("uninterrupted")
    return _launch(_resumable_worker, args=(str(directory), 0, str(directory / "unused")))[0]


def test_relaunch_after_a_lost_worker_resumes_to_the_uninterrupted_weights(
    tmp_path, uninterrupted_weights
):
    import os

    marker = str(tmp_path / "worker1_died")
    # Worker 1 dies in epoch 2 (batch 14 of 30); worker 0 raises UnavailableError; the whole
    # cluster starts again on new ports and resumes from the chief's backup (step 12).
    resumed = _launch(
        _resumable_worker, args=(str(tmp_path / "b"), 14, marker), max_restarts=1, failure_grace=60
    )
    assert os.path.exists(marker)
    np.testing.assert_array_equal(resumed[0], resumed[1])
    np.testing.assert_array_equal(resumed[0], uninterrupted_weights)
    # Spec 67: the backup is removed once training succeeds.
    assert not os.path.exists(tmp_path / "b" / "backup" / "chief")


_RESUMABLE_SCRIPT = """
import sys
import numpy as np
sys.path.insert(0, {tests!r})
from test_multi_worker import _resumable_worker
weights = _resumable_worker({directory!r}, 14, {marker!r})
np.save({directory!r} + "/final-" + str(__import__("os").getpid()) + ".npy", weights)
"""


def test_keras_dist_launch_max_restarts_resumes_a_sigkilled_worker(
    tmp_path, uninterrupted_weights, capsys
):
    import os

    from keras_dist._launch._cli import main as cli_main

    script = tmp_path / "train.py"
    marker = str(tmp_path / "worker1_killed")
    tests = os.path.dirname(os.path.abspath(__file__))
    directory = str(tmp_path / "run")
    os.makedirs(directory)
    script.write_text(_RESUMABLE_SCRIPT.format(tests=tests, directory=directory, marker=marker))
    code = cli_main(["launch", "--workers", "2", "--max-restarts", "1", str(script)])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "killed by SIGKILL" in out and "restart 1 of 1" in out, out
    finals = [np.load(os.path.join(directory, f)) for f in os.listdir(directory) if "final" in f]
    assert len(finals) == 2
    for weights in finals:
        np.testing.assert_array_equal(weights, uninterrupted_weights)


def test_sigterm_to_one_worker_saves_on_every_worker_and_the_rerun_resumes(
    tmp_path, uninterrupted_weights
):
    import os
    import signal
    import time

    marker = tmp_path / "worker1_mid_fit"
    cluster = testing.create_cluster_spec(num_workers=2)
    args = (str(tmp_path), 8, str(marker), True)
    with testing.MultiProcessRunner(
        _resumable_worker, cluster, args=args, devices_per_worker=1, stream_output=False
    ) as runner:
        runner.start()
        deadline = time.monotonic() + TIMEOUT
        while not marker.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        os.kill(runner.process_status()[("worker", 1)].pid, signal.SIGTERM)
        with pytest.raises(testing.UnexpectedSubprocessExitError):
            runner.join(timeout=TIMEOUT)
        # TF's PreemptionCheckpointHandler: every worker saves at the same step, exits 42.
        codes = [runner.exit_code("worker", i) for i in (0, 1)]
        logs = runner.logs("worker", 0) + runner.logs("worker", 1)
    assert codes == [42, 42], logs
    assert (tmp_path / "backup" / "chief").exists()
    assert not (tmp_path / "backup" / "workertemp_1").exists()
    resumed = _launch(_resumable_worker, args=args)
    np.testing.assert_array_equal(resumed[0], uninterrupted_weights)
    np.testing.assert_array_equal(resumed[1], uninterrupted_weights)


def _keras_correctness_worker():
    strategy = kd.MultiWorkerMirroredStrategy()
    import keras

    class IdentityRegularizer(keras.regularizers.Regularizer):
        def __call__(self, x):
            return x

    class AddV(keras.layers.Layer):
        def build(self, _):
            self.v = self.add_weight(
                name="v", shape=(), initializer="ones", regularizer=IdentityRegularizer()
            )

        def call(self, inputs):
            return inputs + self.v

    results = {}
    with strategy.scope():
        # Spec 83: Dense(1, kernel ones) with x in {0, 1}, y = x: accuracy [1.0, 1.0].
        accuracy_model = keras.Sequential(
            [keras.Input((1,)), keras.layers.Dense(1, kernel_initializer="ones", use_bias=False)]
        )
        accuracy_model.compile("sgd", "mse", metrics=[keras.metrics.BinaryAccuracy()])
        # Spec 84: sample weights in evaluate -> 10.625 (13.5 without).
        weighted = keras.Sequential(
            [keras.Input((1,)), keras.layers.Dense(1, kernel_initializer="ones")]
        )
        weighted.compile(keras.optimizers.RMSprop(0.001), "mse")
        # Spec 85: the regularizer counts once: v goes from 1 to -1, not -2.
        x_in = keras.Input((1,), batch_size=2)
        regularized = keras.Model(x_in, AddV()(x_in))
        regularized.compile(keras.optimizers.SGD(1.0), loss=lambda _, y: keras.ops.mean(y))
    x = np.array([[0], [1]] * 8, "float32")
    results["83"] = accuracy_model.fit(x, x, batch_size=4, epochs=2, verbose=0).history[
        "binary_accuracy"
    ]
    x4 = np.array([[0], [1], [2], [3]], "float32")
    y4 = np.array([[2], [4], [6], [8]], "float32")
    weights = np.array([0.25, 0.5, 0.75, 1], "float32")
    results["84"] = weighted.evaluate(x4, y4, batch_size=2, sample_weight=weights, verbose=0)
    results["84_unweighted"] = weighted.evaluate(x4, y4, batch_size=2, verbose=0)
    ones = np.ones((2, 1), "float32")
    regularized.fit(ones, ones, batch_size=2, verbose=0)
    results["85"] = float(regularized.get_weights()[0])
    # tf-keras's loss reductions: a "sum" loss is the global batch's sum (6.30027), and
    # "mean_with_sample_weight" divides by the whole global batch's weights.
    rng = np.random.RandomState(1337)
    x10, y10 = rng.random_sample((64, 10)), rng.random_sample((64, 1))
    sample_weight = rng.random_sample((64,))
    for reduction, weights in (("sum", None), ("mean_with_sample_weight", sample_weight)):
        runs = []
        for scope in (strategy.scope(), contextlib.nullcontext()):
            with scope:
                inputs = keras.Input((10,))
                hidden = keras.layers.Dense(10, kernel_initializer="zeros")(inputs)
                hidden = keras.layers.Dense(10, kernel_initializer="zeros")(hidden)
                model = keras.Model(
                    inputs, keras.layers.Dense(1, kernel_initializer="zeros")(hidden)
                )
                model.compile("sgd", loss=keras.losses.MeanSquaredError(reduction=reduction))
            history = model.fit(
                x10, y10, sample_weight=weights, batch_size=32, shuffle=False, verbose=0
            )
            runs.append(history.history["loss"] + [float(w.sum()) for w in model.get_weights()])
        results[reduction] = runs
    # predict's eager steps (jit_compile=False) give every worker's rows, in order.
    with strategy.scope():
        identity = keras.Sequential([keras.Input((1,)), keras.layers.Identity()])
        identity.compile(jit_compile=False)
    rows = np.arange(37, dtype="float32").reshape(37, 1)
    results["eager_predict"] = [
        identity.predict(rows, batch_size=size, verbose=0)[:, 0].tolist() for size in (3, 16)
    ]
    return results


def test_keras_correctness_cases_on_two_workers_match_tf():
    for result in _launch(_keras_correctness_worker):
        assert result["83"] == [1.0, 1.0]
        assert result["84"] == pytest.approx(10.625, rel=1e-6)
        assert result["84_unweighted"] == pytest.approx(13.5, rel=1e-6)
        assert result["85"] == -1.0
        for reduction in ("sum", "mean_with_sample_weight"):
            distributed, one_device = result[reduction]
            np.testing.assert_allclose(distributed, one_device, rtol=1e-5, atol=1e-7)
        assert result["sum"][0][0] == pytest.approx(6.30027, rel=1e-5)
        assert result["eager_predict"] == [list(range(37))] * 2


def test_keras_dist_launch_runs_the_multi_worker_example(tmp_path):
    import re
    import subprocess
    import sys
    from pathlib import Path

    example = Path(__file__).resolve().parents[2] / "examples" / "multi_worker_fit.py"
    command = [sys.executable, "-m", "keras_dist._launch._cli", "launch", "--workers", "2"]
    command += [str(example), "--epochs", "2", "--output", str(tmp_path)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=TIMEOUT)
    assert done.returncode == 0, done.stdout + done.stderr
    accuracies = re.findall(
        r"\[worker (\d)\] worker \1: .*final test accuracy: ([\d.]+)", done.stdout
    )
    assert len(accuracies) == 2 and accuracies[0][1] == accuracies[1][1], done.stdout
    assert float(accuracies[0][1]) > 0.5
    # The backup is deleted, its directory too, as Keras's BackupAndRestore does.
    assert sorted(p.name for p in tmp_path.iterdir()) == ["logs", "model.keras"]


def _hand_started_worker():
    import json
    import os

    import jax

    # A JAX program that starts jax.distributed itself, without TF_CONFIG.
    config = json.loads(os.environ.pop("TF_CONFIG"))
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(
        config["cluster"]["worker"][0], num_processes=2, process_id=config["task"]["index"]
    )
    strategy = kd.MultiWorkerMirroredStrategy()
    return (
        strategy.num_replicas_in_sync,
        strategy.cluster_resolver.task_id,
        strategy.extended.should_checkpoint,
        float(strategy.reduce("SUM", strategy.run(lambda: 1.0), axis=None)),
    )


def test_a_hand_started_jax_distributed_job_has_one_worker_per_process():
    assert _launch(_hand_started_worker) == [(2, 0, True, 2.0), (2, 1, False, 2.0)]


def _reduce_after_worker_1_crashes_once(marker):
    import os

    strategy = kd.MultiWorkerMirroredStrategy()
    strategy.reduce("SUM", strategy.run(lambda: 1.0), axis=None)  # connects the workers
    if strategy.cluster_resolver.task_id == 1 and not os.path.exists(marker):
        open(marker, "w").close()
        os._exit(1)  # spec 68: worker 1 crashes on its first run
    return float(strategy.reduce("SUM", strategy.run(lambda: 1.0), axis=None))


def test_a_restarted_cluster_gives_tf_results_after_a_crash(tmp_path):
    # Spec 68's auto_restart case: the results are [2., 2.]. JAX processes cannot rejoin a
    # running cluster, so the whole cluster restarts (kd.launch's max_restarts).
    marker = str(tmp_path / "crashed")
    results = _launch(
        _reduce_after_worker_1_crashes_once, args=(marker,), max_restarts=1, failure_grace=60
    )
    assert results == [2.0, 2.0]


def _uneven_data_worker():
    strategy = kd.MultiWorkerMirroredStrategy()
    task_id = strategy.cluster_resolver.task_id
    with strategy.scope():
        model = _tiny_model()
    x, y = _regression_data(64 if task_id == 0 else 40)  # 4 batches of 16, or 3 (last 8)
    model.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0)


def test_workers_given_different_data_get_a_clear_error():
    with pytest.raises(ValueError) as error:
        _launch(_uneven_data_worker)
    message = str(error.value)
    assert "The workers were given different data" in message
    assert "worker 0: 4 batches of 16 rows" in message
    assert "worker 1: 3 batches of 16 rows (the last of 8)" in message


def _keras_backup_worker(directory):
    import keras

    strategy = kd.MultiWorkerMirroredStrategy()
    with strategy.scope():
        model = _tiny_model()
    x, y = _regression_data(32)
    model.fit(
        x, y, batch_size=16, verbose=0, callbacks=[keras.callbacks.BackupAndRestore(directory)]
    )


def test_keras_own_backup_and_restore_across_workers_is_a_clear_error(tmp_path):
    # Before: both workers wrote the same files (BlockingIOError or FileExistsError), and
    # the peer of the one that raised died in JAX's abort.
    with pytest.raises(ValueError, match="Use kd.callbacks.BackupAndRestore"):
        _launch(_keras_backup_worker, args=(str(tmp_path / "backup"),))


def _best_checkpoint_worker(directory, interrupt):
    """Fits 4 epochs with scores 1.0, 0.5, 0.9, 0.8; the first run stops after epoch 1."""
    strategy = kd.MultiWorkerMirroredStrategy(
        communication_options=kd.experimental.CommunicationOptions(timeout_seconds=60)
    )
    import os

    import keras

    class Score(keras.callbacks.Callback):
        def on_epoch_end(self, epoch, logs=None):
            logs["score"] = [1.0, 0.5, 0.9, 0.8][epoch]

    class Interrupt(keras.callbacks.Callback):
        def on_epoch_end(self, epoch, logs=None):
            if interrupt and epoch == 1:
                raise RuntimeError("interrupted")

    with strategy.scope():
        model = _tiny_model()
    x, y = _regression_data(64)
    checkpoint = kd.callbacks.ModelCheckpoint(
        os.path.join(directory, "best_{epoch}.weights.h5"),
        monitor="score",
        mode="min",
        save_best_only=True,
        save_weights_only=True,
    )
    backup = kd.callbacks.BackupAndRestore(os.path.join(directory, "backup"))
    try:
        history = model.fit(
            x,
            y,
            batch_size=16,
            epochs=4,
            verbose=0,
            callbacks=[Score(), backup, checkpoint, Interrupt()],
        )
    except RuntimeError:
        return None
    return history.epoch


def test_model_checkpoint_best_survives_a_restart_on_every_worker(tmp_path):
    import os

    def saved():
        return sorted(f for f in os.listdir(tmp_path) if f.endswith(".h5"))

    assert _launch(_best_checkpoint_worker, args=(str(tmp_path), True)) == [None, None]
    assert saved() == ["best_1.weights.h5", "best_2.weights.h5"]
    # Restarted: both workers resume at epoch 2 with the chief's best (0.5), so the worse
    # epochs 2 and 3 overwrite nothing, on the chief or in a worker's temporary directory.
    epochs = _launch(_best_checkpoint_worker, args=(str(tmp_path), False))
    assert epochs == [[2, 3], [2, 3]]
    assert saved() == ["best_1.weights.h5", "best_2.weights.h5"]
    # No worker's temporary directory is left, and the backup is gone once training ended.
    # (As Keras's, the backup directory itself is removed.)
    assert sorted(os.listdir(tmp_path)) == ["best_1.weights.h5", "best_2.weights.h5"]


def _chief_alone_reads_first_weights():
    strategy = kd.MultiWorkerMirroredStrategy(
        communication_options=kd.experimental.CommunicationOptions(timeout_seconds=30)
    )
    import keras

    keras.utils.set_random_seed(strategy.cluster_resolver.task_id)  # different first values
    with strategy.scope():
        model = _tiny_model()
    # Leaving the scope agreed on worker 0's first values; reading them is local.
    first = _flat(model.get_weights()) if strategy.extended.should_checkpoint else None
    x, y = _regression_data(32)
    model.fit(x, y, batch_size=8, epochs=1, verbose=0)
    return first, _flat(model.get_weights())


def test_the_chief_alone_may_read_the_first_weights():
    # Before: the first read synced the first values with a collective, so a read on
    # the chief alone waited for the others (or crashed gloo on a size mismatch).
    (first, chief_final), (none, worker_final) = _launch(_chief_alone_reads_first_weights)
    assert none is None
    np.testing.assert_array_equal(chief_final, worker_final)
    import keras

    keras.utils.set_random_seed(0)  # worker 0's first values
    np.testing.assert_array_equal(first, _flat(_tiny_model().get_weights()))


def _pipeline_of(context):
    """One pipeline per worker (TF's DatasetCreator): per-replica batches of its own rows."""
    rng = np.random.default_rng(100 + context.input_pipeline_id)
    rows = context.get_per_replica_batch_size(8)
    while True:
        x = rng.normal(size=(rows, 3)).astype("float32")
        yield x, x.sum(axis=1, keepdims=True)


def _dataset_creator_worker():
    strategy = kd.MultiWorkerMirroredStrategy()
    import keras

    keras.utils.set_random_seed(0)
    with strategy.scope():
        model = _tiny_model()
    first = _flat(model.get_weights())
    contexts = []

    def dataset_fn(context):
        contexts.append((context.num_input_pipelines, context.input_pipeline_id))
        return _pipeline_of(context)

    creator = kd.experimental.DatasetCreator(dataset_fn)
    model.fit(creator, epochs=2, steps_per_epoch=4, verbose=0)
    return {"first": first, "final": _flat(model.get_weights()), "contexts": contexts}


def test_dataset_creator_builds_one_pipeline_per_worker():
    import keras

    chief, worker = _launch(_dataset_creator_worker)
    assert chief["contexts"] == [(2, 0)] and worker["contexts"] == [(2, 1)]
    np.testing.assert_array_equal(chief["final"], worker["final"])
    # One device on the same global batches: step k is worker 0's k-th batch of 4
    # rows, then worker 1's.
    pipelines = [_pipeline_of(kd.InputContext(2, i, 2)) for i in (0, 1)]
    steps = [[next(p) for p in pipelines] for _ in range(8)]
    x = np.concatenate([b[0] for step in steps for b in step])
    y = np.concatenate([b[1] for step in steps for b in step])
    model = _tiny_model()
    shapes = [w.shape for w in model.get_weights()]
    split = np.split(chief["first"], np.cumsum([int(np.prod(s)) for s in shapes])[:-1])
    model.set_weights([w.reshape(s) for w, s in zip(split, shapes)])
    keras.utils.set_random_seed(0)
    model.fit(x, y, batch_size=8, shuffle=False, verbose=0)
    np.testing.assert_allclose(chief["final"], _flat(model.get_weights()), atol=1e-5)


def _local_results_in_function_worker():
    strategy = kd.MultiWorkerMirroredStrategy()
    import jax.numpy as jnp

    def replica_id():
        return jnp.float32(kd.get_replica_context().replica_id_in_sync_group)

    @kd.function
    def step():
        return {"local": strategy.experimental_local_results(strategy.run(replica_id))}

    eager = strategy.experimental_local_results(strategy.run(replica_id))
    # A value that is not distributed is one component per worker (TF's
    # ``_make_tensor_into_per_replica``), however many devices the worker has.
    task = strategy.cluster_resolver.task_id
    plain = np.asarray(strategy.gather(np.array([[task, 7]]), axis=0)).tolist()
    return [float(x) for x in step()["local"]], [float(x) for x in eager], plain


def test_local_results_inside_kd_function_are_this_workers():
    # Before: each worker got all 4 replicas' components back from the function.
    (compiled_0, eager_0, plain_0), (compiled_1, eager_1, plain_1) = _launch(
        _local_results_in_function_worker, devices=2
    )
    assert compiled_0 == eager_0 == [0.0, 1.0]
    assert compiled_1 == eager_1 == [2.0, 3.0]
    assert plain_0 == plain_1 == [[0, 7], [1, 7]]


def _multi_step_function_worker():
    import keras

    strategy = kd.MultiWorkerMirroredStrategy()
    with strategy.scope():
        total = keras.Variable(0.0, aggregation="sum")
    data = [np.full(4, float(i), "float32") for i in range(7)] + [np.full(3, 100.0, "float32")]
    iterator = iter(strategy.experimental_distribute_dataset(data))

    @kd.function
    def add_steps(iterator, steps):
        for _ in range(steps):
            strategy.run(lambda x: total.assign_add(keras.ops.sum(x)), args=(next(iterator),))
        return total.value

    results = []
    with pytest.raises(kd.errors.OutOfRangeError):
        while True:
            results.append(float(add_steps(iterator, 3)))
    return results, float(total.value), add_steps.experimental_get_tracing_count()


def test_a_loop_of_steps_on_next_is_one_program_on_every_worker():
    # Every worker reads as many elements a call and agrees when the last call, with the
    # partial batch of 3 rows, runs as Python: [0, 1, 2] then [3, 4, 5] as programs.
    for results, total, traces in _launch(_multi_step_function_worker):
        assert results == [12.0, 60.0]
        assert total == 4.0 * sum(range(7)) + 300.0
        assert traces == 1


def _logs_its_layout():
    import logging

    logging.basicConfig(level=logging.INFO)
    kd.MultiWorkerMirroredStrategy()
    return "ok"


def test_each_worker_logs_which_task_it_is():
    # TF's "MultiWorkerMirroredStrategy with cluster_spec = ..., task_type = 'worker',
    # task_id = 1" line: a log started by hand says which task wrote it.
    cluster = testing.create_cluster_spec(num_workers=2)
    with testing.MultiProcessRunner(
        _logs_its_layout, cluster, devices_per_worker=1, stream_output=False
    ) as runner:
        runner.start()
        runner.join(timeout=TIMEOUT)
        for index in range(2):
            log = runner.logs("worker", index)
            assert f"this process is worker {index} (process {index} of 2)" in log, log
