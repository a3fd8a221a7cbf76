"""``TPUStrategy``, ``TPUClusterResolver`` and ``kd.tpu.experimental`` on simulated cores.

No TPU is available where these run: ``TPUClusterResolver(tpu="simulated")``
makes the CPU devices (8 simulated, see conftest) stand in for TPU cores,
with the same code path except device discovery. Numbers are compared with
``OneDeviceStrategy("/cpu:0")`` started from the same weights.
"""

import jax
import keras
import numpy as np
import pytest

import keras_dist as kd

TPU = kd.tpu.experimental


def _resolver():
    return kd.cluster_resolver.TPUClusterResolver(tpu="simulated")


def _strategy(num_replicas, cores_per_replica=1):
    resolver = _resolver()
    topology = TPU.initialize_tpu_system(resolver)
    assignment = TPU.DeviceAssignment.build(
        topology, computation_shape=[cores_per_replica, 1, 1, 1], num_replicas=num_replicas
    )
    return kd.TPUStrategy(resolver, experimental_device_assignment=assignment)


# ---------------------------------------------------------------- strategy


def test_four_simulated_cores_are_four_replicas_and_replica_ids_sum_to_6():
    strategy = _strategy(4)
    assert strategy.num_replicas_in_sync == 4
    assert strategy.extended.worker_devices == tuple(
        f"/job:localhost/replica:0/task:0/device:CPU:{i}" for i in range(4)
    )
    ids = strategy.run(lambda: kd.get_replica_context().replica_id_in_sync_group)
    assert int(strategy.reduce(kd.ReduceOp.SUM, ids, axis=None)) == 6
    assert float(strategy.reduce(kd.ReduceOp.MEAN, ids, axis=None)) == 1.5


def test_default_assignment_uses_every_core_of_the_resolver():
    strategy = kd.TPUStrategy(_resolver())
    assert strategy.num_replicas_in_sync == len(jax.devices("cpu"))
    assert isinstance(strategy.cluster_resolver, kd.cluster_resolver.TPUClusterResolver)


def test_tpu_strategy_names_and_static_shapes():
    strategy = _strategy(2)
    assert kd.experimental.TPUStrategy is kd.TPUStrategy
    assert kd.strategies.TPUStrategy is kd.TPUStrategy
    assert strategy.extended.experimental_require_static_shapes is True
    assert kd.MirroredStrategy(["/cpu:0"]).extended.experimental_require_static_shapes is False
    assert repr(strategy).startswith("TPUStrategy(devices=")


def test_tpu_strategy_refuses_another_resolver():
    resolver = kd.cluster_resolver.SimpleClusterResolver(kd.cluster_resolver.ClusterSpec({}))
    with pytest.raises(TypeError, match=r"TPUClusterResolver.*Received: tpu_cluster_resolver="):
        kd.TPUStrategy(resolver)
    with pytest.raises(TypeError, match="DeviceAssignment"):
        kd.TPUStrategy(_resolver(), experimental_device_assignment=[[0, 1]])


def test_custom_loop_partial_batch_is_split_as_tf_splits_it():
    strategy = _strategy(4)
    dataset = strategy.experimental_distribute_dataset([np.arange(10.0, dtype="float32")])
    (batch,) = list(dataset)
    rows = [np.asarray(c).tolist() for c in strategy.experimental_local_results(batch)]
    assert rows == [[0.0, 1.0, 2.0], [3.0, 4.0, 5.0], [6.0, 7.0, 8.0], [9.0]]
    total = strategy.run(lambda x: keras.ops.sum(x), args=(batch,))
    assert float(strategy.reduce("SUM", total, axis=None)) == 45.0


# --------------------------------------------------------------------- fit


def _model(weights=None):
    model = keras.Sequential(
        [
            keras.Input((3,)),
            keras.layers.Dense(8, activation="relu"),
            keras.layers.Dense(1),
        ]
    )
    if weights is not None:
        model.set_weights(weights)
    return model


def _fit(strategy, weights, x, y, steps_per_execution=1):
    with strategy.scope():
        model = _model(weights)
        model.compile(
            optimizer=keras.optimizers.SGD(0.05),
            loss="mse",
            metrics=["mae"],
            steps_per_execution=steps_per_execution,
        )
    history = model.fit(x, y, batch_size=16, epochs=3, shuffle=False, verbose=0).history
    evaluation = model.evaluate(x, y, batch_size=16, verbose=0)
    return model.get_weights(), history, evaluation


@pytest.mark.parametrize(
    "rows,steps_per_execution", [(64, 1), (64, 2), (58, 1)], ids=["even", "spe2", "partial"]
)
def test_fit_under_tpu_strategy_equals_one_device(rows, steps_per_execution):
    rng = np.random.default_rng(0)
    x = rng.uniform(size=(rows, 3)).astype("float32")
    y = (x @ np.array([[1.0], [-2.0], [0.5]], "float32")).astype("float32")
    keras.utils.set_random_seed(0)
    weights = _model().get_weights()
    expected = _fit(kd.OneDeviceStrategy("/cpu:0"), weights, x, y, steps_per_execution)
    actual = _fit(_strategy(4), weights, x, y, steps_per_execution)
    for a, e in zip(actual[0], expected[0]):
        np.testing.assert_allclose(a, e, rtol=1e-5, atol=1e-5)
    assert actual[1].keys() == expected[1].keys()
    for key in expected[1]:
        np.testing.assert_allclose(actual[1][key], expected[1][key], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(actual[2], expected[2], rtol=1e-5, atol=1e-5)


# --------------------------------------------------------------- resolver


def test_local_resolver_without_tpus_names_what_it_looked_for():
    with pytest.raises(ValueError) as raised:
        kd.cluster_resolver.TPUClusterResolver(tpu="local")
    message = str(raised.value)
    assert "found no TPU devices" in message
    assert "jax.devices('tpu')" in message
    assert "platforms: cpu" in message
    assert 'tpu="simulated"' in message
    assert message.endswith("Received: tpu='local'")
    with pytest.raises(ValueError, match="found no TPU devices"):
        kd.TPUStrategy()  # TF's default resolver: this machine's TPUs


def test_remote_tpu_names_are_refused_with_the_fix():
    with pytest.raises(ValueError, match=r"remote TPU node.*Received: tpu='grpc://10.0.0.2:8470'"):
        kd.cluster_resolver.TPUClusterResolver(tpu="grpc://10.0.0.2:8470")


def test_simulated_resolver_answers_as_a_one_host_tpu():
    resolver = kd.cluster_resolver.TPUClusterResolver.connect(tpu="simulated")
    assert resolver.simulated
    assert resolver.tpu_devices == tuple(jax.devices("cpu"))
    assert resolver.num_accelerators() == {"TPU": 8}
    assert resolver.master() == resolver.get_master() == ""
    assert resolver.cluster_spec().as_dict() == {}
    assert (resolver.task_type, resolver.task_id, resolver.get_job_name()) == (
        "worker",
        0,
        "worker",
    )


# -------------------------------------------------------- topology, assignment


def test_topology_of_simulated_cores_is_a_line():
    topology = TPU.initialize_tpu_system(_resolver())
    assert topology.mesh_shape.tolist() == [8, 1, 1, 1]
    assert (topology.num_tasks, topology.num_tpus_per_task, topology.mesh_rank) == (1, 8, 4)
    assert topology.device_coordinates.shape == (1, 8, 4)
    assert topology.device_coordinates[0, 5].tolist() == [5, 0, 0, 0]
    assert topology.missing_devices.shape == (0, 4)
    assert topology.task_ordinal_at_coordinates([3, 0, 0, 0]) == 0
    assert topology.tpu_device_ordinal_at_coordinates([3, 0, 0, 0]) == 3
    assert topology.device_at_coordinates([3, 0, 0, 0]) == jax.devices("cpu")[3]
    assert topology.tpu_device_name_at_coordinates([3, 0, 0, 0]) == (
        "/job:worker/replica:0/task:0/device:TPU:3"
    )
    with pytest.raises(ValueError, match=r"No device at coordinates \[9, 0, 0, 0\]"):
        topology.task_ordinal_at_coordinates([9, 0, 0, 0])
    TPU.shutdown_tpu_system()


def test_topology_from_coordinates_knows_no_devices():
    topology = TPU.Topology(mesh_shape=[2, 2, 1, 1], device_coordinates=[[[0, 0, 0, 0]]])
    assert topology.missing_devices.tolist() == [[0, 1, 0, 0], [1, 0, 0, 0], [1, 1, 0, 0]]
    with pytest.raises(ValueError, match="knows no devices"):
        topology.device_at_coordinates([0, 0, 0, 0])
    with pytest.raises(ValueError, match="serialized TopologyProto"):
        TPU.Topology(serialized=b"\x08\x01")


def test_topology_given_devices_knows_them():
    cpus = jax.devices("cpu")[:2]
    coordinates = [[[0, 0, 0, 0], [1, 0, 0, 0]]]
    topology = TPU.Topology(mesh_shape=[2, 1, 1, 1], device_coordinates=coordinates, devices=[cpus])
    assert topology.device_at_coordinates([1, 0, 0, 0]) == cpus[1]
    with pytest.raises(ValueError, match=r"one device per coordinate, .*\[1, 2\]"):
        TPU.Topology(mesh_shape=[2, 1, 1, 1], device_coordinates=coordinates, devices=[cpus[:1]])


def test_device_assignment_2x2_on_a_line_of_cores():
    topology = TPU.Topology.from_devices(jax.devices("cpu")[:4])
    assignment = TPU.DeviceAssignment.build(topology, [2, 1, 1, 1], num_replicas=2)
    assert (assignment.num_replicas, assignment.num_cores_per_replica) == (2, 2)
    assert assignment.core_assignment[:, :, 0].tolist() == [[0, 1], [2, 3]]
    assert assignment.coordinates(1, 1) == (3, 0, 0, 0)
    assert assignment.lookup_replicas(0, 0) == [0, 1]
    assert assignment.tpu_ordinal(1, 0) == 2
    assert assignment.tpu_device(1, 1) == "/job:worker/replica:0/task:0/device:TPU:3"
    assert assignment.host_device(1, 1) == "/job:worker/replica:0/task:0/device:CPU:0"
    cpu = jax.devices("cpu")
    assert assignment.devices == ((cpu[0], cpu[1]), (cpu[2], cpu[3]))
    with pytest.raises(ValueError, match="Can not find any replica in task: 1"):
        assignment.lookup_replicas(1, 0)


def test_device_assignment_stride_and_defaults():
    topology = TPU.Topology.from_devices(jax.devices("cpu")[:8])
    strided = TPU.DeviceAssignment.build(topology, [2, 1, 1, 1], [2, 1, 1, 1], num_replicas=4)
    assert strided.core_assignment[:, :, 0].tolist() == [[0, 2], [1, 3], [4, 6], [5, 7]]
    single = TPU.DeviceAssignment.build(topology)
    assert (single.num_replicas, single.num_cores_per_replica) == (1, 1)


def test_device_assignment_errors_say_what_was_received():
    topology = TPU.Topology.from_devices(jax.devices("cpu")[:4])
    with pytest.raises(ValueError, match=r"only 2 replicas of shape \[2, 1, 1, 1\]"):
        TPU.DeviceAssignment.build(topology, [2, 1, 1, 1], num_replicas=3)
    with pytest.raises(ValueError, match=r"must evenly divide.*Received: computation_shape"):
        TPU.DeviceAssignment.build(topology, [3, 1, 1, 1])
    with pytest.raises(ValueError, match=r"4 positive integers.*Received: computation_shape=\[2\]"):
        TPU.DeviceAssignment.build(topology, [2])
    with pytest.raises(ValueError, match="one replica's logical core only"):
        TPU.DeviceAssignment(topology, [[[0, 0, 0, 0]], [[0, 0, 0, 0]]])


def test_initialize_needs_a_tpu_resolver():
    with pytest.raises(TypeError, match="needs a kd.cluster_resolver.TPUClusterResolver"):
        TPU.initialize_tpu_system(kd.cluster_resolver.TFConfigClusterResolver())
