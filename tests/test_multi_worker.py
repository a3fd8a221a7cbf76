"""MultiWorkerMirroredStrategy across real local processes (TF_CONFIG, 127.0.0.1 ports).

Each test starts a small cluster with ``kd.launch`` or ``kd.testing.MultiProcessRunner``;
the functions below run in the worker processes and return what the test checks.
Expected values are TF's (spec §B 16, §G 50–53, §K, §I 66–68) or a single device's.
"""

import numpy as np
import pytest

import keras_dist as kd
from keras_dist import testing

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
        # Replica ids are int32: MEAN divides as integers, as TF does.
        assert result["sum_ids"] == 1.0 and result["mean_ids"] == 0.0
        assert result["gather"] == [0, 0, 1, 1]
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
    for _ in range(steps):  # DESIGN §8: overlapping collectives hung across processes
        out = strategy.run(step, args=(values,))
    batches = strategy.experimental_distribute_dataset(_numpy(np.arange(15), 4))
    return {
        "ids": _local(strategy, strategy.run(ids_of_replica)),
        "sum_of_ones": float(strategy.reduce("SUM", strategy.run(lambda: 1.0), axis=None)),
        "stress": _local(strategy, out),
        "last_batch": [_local(strategy, b) for b in batches][-1],
    }


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
    return {
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


# ------------------------------------------------------------------------------ failures
def _loses_worker_1(how, timeout_seconds):
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
                time.sleep(3600)  # stuck outside the collective

    with strategy.scope():
        model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
        model.compile(optimizer="sgd", loss="mse")
    x, y = np.ones((640, 3), "float32"), np.ones((640, 1), "float32")
    start = time.monotonic()
    try:
        model.fit(x, y, batch_size=16, epochs=3, verbose=0, callbacks=[LoseWorker1()])
    except kd.errors.OpError as error:
        print(f"SURVIVOR {type(error).__name__} after {time.monotonic() - start:.1f} s: {error}")
        raise
    return "finished"


def _run_losing_worker_1(how, timeout_seconds):
    cluster = testing.create_cluster_spec(num_workers=2)
    with testing.MultiProcessRunner(
        _loses_worker_1,
        cluster,
        args=(how, timeout_seconds),
        devices_per_worker=1,
        stream_output=False,
        dependence_on_chief=False,
        failure_grace=90,
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


def test_a_killed_worker_makes_the_survivor_raise_naming_it():
    # Spec 68: the survivor raises UnavailableError within 60 s, and exits.
    log, survivor_code, lost_code = _run_losing_worker_1("dies", timeout_seconds=60)
    assert lost_code == 17
    assert "SURVIVOR UnavailableError" in log, log
    assert "Lost contact with worker 1" in log
    assert _seconds_until_error(log) < 60
    assert survivor_code == 1


def test_a_stuck_worker_makes_the_survivor_raise_deadline_exceeded():
    log, survivor_code, _ = _run_losing_worker_1("hangs", timeout_seconds=8)
    assert "SURVIVOR DeadlineExceededError" in log, log
    assert "within 8 s: worker 1 did not reach it" in log
    assert 8 <= _seconds_until_error(log) < 30
    assert survivor_code == 1
