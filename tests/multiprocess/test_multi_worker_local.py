"""MultiWorkerMirroredStrategy in one process: options, cluster layout and errors.

The multi-process behaviour is tested with real processes in test_multi_worker.py.
"""

import json

import numpy as np
import pytest

import keras_dist as kd
from keras_dist.cluster_resolver import ClusterSpec
from keras_dist.cluster_resolver import SimpleClusterResolver
from keras_dist.strategies._multi_worker_mirrored import _ProcessLayout

CHIEF_AND_TWO = {"chief": ["c:1"], "worker": ["w0:1", "w1:1"]}


def _layout(cluster, task_type, task_id):
    return _ProcessLayout(
        SimpleClusterResolver(ClusterSpec(cluster), task_type=task_type, task_id=task_id)
    )


def test_without_a_cluster_it_is_one_worker_on_the_local_devices(monkeypatch):
    monkeypatch.delenv("TF_CONFIG", raising=False)
    strategy = kd.MultiWorkerMirroredStrategy()
    assert strategy.num_replicas_in_sync == 8
    assert strategy.extended.should_checkpoint and strategy.extended.should_save_summary
    assert strategy.extended.experimental_between_graph
    assert strategy.cluster_resolver.task_type is None
    assert float(strategy.reduce("SUM", strategy.run(lambda: 1.0), axis=None)) == 8.0


def test_a_one_worker_cluster_trains_like_mirrored(monkeypatch):
    monkeypatch.setenv(
        "TF_CONFIG",
        '{"cluster": {"worker": ["127.0.0.1:1"]}, "task": {"type": "worker", "index": 0}}',
    )
    strategy = kd.MultiWorkerMirroredStrategy()
    assert strategy.cluster_resolver.task_type == "worker"
    assert strategy.extended.worker_devices[0] == "/job:worker/replica:0/task:0/device:CPU:0"
    values = strategy.experimental_distribute_values_from_function(
        lambda ctx: ctx.replica_id_in_sync_group
    )
    assert float(strategy.reduce("SUM", values, axis=None)) == sum(range(8))


def test_process_ids_put_the_chief_first_and_the_coordinator_is_the_chief():
    chief = _layout(CHIEF_AND_TWO, "chief", 0)
    worker1 = _layout(CHIEF_AND_TWO, "worker", 1)
    assert (chief.num_workers, chief.process_id, chief.coordinator) == (3, 0, "c:1")
    assert (worker1.process_id, worker1.coordinator) == (2, "c:1")
    assert chief.task_names() == ["chief 0", "worker 0", "worker 1"]
    assert chief.is_chief and not worker1.is_chief


def test_without_a_chief_worker_0_coordinates_and_is_chief():
    spec = {"worker": ["w0:1", "w1:1", "w2:1"]}
    # Spec 64: (should_checkpoint, should_save_summary) is (T, T) on w0 only.
    flags = [_layout(spec, "worker", i).is_chief for i in range(3)]
    assert flags == [True, False, False]
    assert _layout(spec, "worker", 2).coordinator == "w0:1"


def test_a_cluster_without_a_task_raises_tf_message():
    with pytest.raises(
        ValueError,
        match="When `cluster_spec` is given, you must also specify `task_type` and `task_id`",
    ):
        _layout(CHIEF_AND_TWO, None, None)


def test_ps_tasks_are_refused_and_an_evaluator_runs_alone():
    with pytest.raises(ValueError, match="'chief' and 'worker' tasks only"):
        _layout({"worker": ["w0:1"], "ps": ["p:1"]}, "ps", 0)
    evaluator = _layout({"worker": ["w0:1", "w1:1"], "evaluator": ["e:1"]}, "evaluator", 0)
    assert (evaluator.num_workers, evaluator.coordinator, evaluator.is_chief) == (1, None, True)


def test_communication_options_validate_like_tf():
    options = kd.experimental.CommunicationOptions(
        bytes_per_pack=1024, timeout_seconds=5, implementation="ring"
    )
    assert options.implementation is kd.experimental.CommunicationImplementation.RING
    assert kd.experimental.CollectiveCommunication is kd.experimental.CommunicationImplementation
    with pytest.raises(ValueError, match="bytes_per_pack"):
        kd.experimental.CommunicationOptions(bytes_per_pack=-1)
    with pytest.raises(ValueError, match="timeout_seconds"):
        kd.experimental.CommunicationOptions(timeout_seconds=0)
    with pytest.raises(ValueError, match="AUTO, RING or NCCL"):
        kd.experimental.CommunicationOptions(implementation="MPI")
    with pytest.raises(TypeError, match="CommunicationOptions"):
        kd.MultiWorkerMirroredStrategy(communication_options={"timeout_seconds": 3})


def test_experimental_alias_takes_tf_communication_argument(monkeypatch):
    monkeypatch.delenv("TF_CONFIG", raising=False)
    strategy = kd.experimental.MultiWorkerMirroredStrategy(
        communication=kd.experimental.CommunicationImplementation.RING
    )
    assert strategy.extended._options.implementation.name == "RING"


def test_jax_already_started_gives_a_clear_error(monkeypatch):
    # This test process has used JAX already; a real two-worker cluster
    # cannot start any more, and the strategy says so instead of failing in JAX.
    cluster = {"worker": ["127.0.0.1:1", "127.0.0.1:2"]}
    monkeypatch.setenv(
        "TF_CONFIG", json.dumps({"cluster": cluster, "task": {"type": "worker", "index": 1}})
    )
    with pytest.raises(RuntimeError, match="must be created before JAX starts"):
        kd.MultiWorkerMirroredStrategy()


def test_input_context_of_one_worker(monkeypatch):
    monkeypatch.delenv("TF_CONFIG", raising=False)
    strategy = kd.MultiWorkerMirroredStrategy()
    contexts = []

    def dataset_fn(context):
        contexts.append(context)
        return [np.arange(16.0)]

    next(iter(strategy.distribute_datasets_from_function(dataset_fn)))
    (context,) = contexts
    assert (
        context.num_input_pipelines,
        context.input_pipeline_id,
        context.num_replicas_in_sync,
    ) == (1, 0, 8)
