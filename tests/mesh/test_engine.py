"""The compiled engine: traces per signature, state threading, fused collectives."""

import jax
import keras
import numpy as np
import pytest
from conftest import cpus

import keras_dist as kd


def _entries(strategy):
    return list(strategy.extended._compiled._cache.values())


def test_traces_once_per_input_signature():
    strategy = kd.MirroredStrategy(cpus(4))
    engine = strategy.extended._compiled
    calls = []

    def step(x):
        calls.append(1)
        return x * 2

    x8 = strategy.experimental_distribute_values_from_function(lambda c: np.ones((2,), "float32"))
    for _ in range(3):
        strategy.run(step, args=(x8,))
    assert engine.trace_count == 1
    x3 = strategy.experimental_distribute_values_from_function(lambda c: np.ones((3,), "float32"))
    for _ in range(3):
        out = strategy.run(step, args=(x3,))
    assert engine.trace_count == 2
    assert [v.tolist() for v in strategy.experimental_local_results(out)] == [[2.0] * 3] * 4
    # A different Python constant is a different signature.
    strategy.run(lambda x, k: x * k, args=(x3, 3.0))
    strategy.run(lambda x, k: x * k, args=(x3, 3.0))
    assert engine.trace_count == 4  # a new lambda object each call: traced each time


def test_step_reducing_fifty_gradients_issues_one_all_reduce():
    strategy = kd.MirroredStrategy(cpus(4))
    with strategy.scope():
        weights = [keras.Variable(np.full((3,), float(i), "float32")) for i in range(50)]
        optimizer = keras.optimizers.SGD(0.5)
        optimizer.build(weights)

    def step(x):
        def loss_fn():
            return kd.nn.compute_average_loss(sum(w * x for w in weights))

        loss, grads = kd.value_and_grad(loss_fn, weights)()
        optimizer.apply_gradients(zip(grads, weights))
        return loss

    x = strategy.experimental_distribute_dataset([np.ones((8, 3), "float32")])
    traces = strategy.extended._compiled.trace_count
    for batch in x:
        strategy.run(step, args=(batch,))
    assert strategy.extended._compiled.trace_count == traces + 1
    (entry,) = _entries(strategy)
    # One all-reduce for the 50 gradients (packed: 50 x 3 floats), one for the
    # returned loss (summed in the same program for `strategy.reduce`).
    text = entry.lowered.as_text()
    assert text.count("stablehlo.all_reduce") == 2
    assert '"stablehlo.all_reduce"(%' in text and "tensor<150xf32>" in text
    # Each replica's gradient of the per-replica mean is 1/4 per row-sum of x; summed: 1.
    np.testing.assert_allclose(weights[7].numpy(), np.full((3,), 7.0 - 0.5))


def test_variables_created_on_first_call_are_kept():
    strategy = kd.MirroredStrategy(cpus(2))
    with strategy.scope():
        w = keras.Variable(np.ones((2,), "float32"))
        optimizer = keras.optimizers.Adam(0.1)  # builds its slots on first apply

    def step():
        _, grads = kd.value_and_grad(lambda: kd.nn.compute_average_loss(w * 1.0), [w])()
        optimizer.apply_gradients(zip(grads, [w]))

    strategy.run(step)
    strategy.run(step)
    assert int(optimizer.iterations.numpy()) == 2
    assert all(isinstance(v, kd.MirroredVariable) for v in optimizer.variables)
    # Adam's first steps move by the learning rate.
    np.testing.assert_allclose(w.numpy(), [0.8, 0.8], rtol=1e-5)


def test_variable_created_outside_scope_is_read_but_not_written():
    outside = keras.Variable(5.0)
    strategy = kd.MirroredStrategy(cpus(2))
    out = strategy.run(lambda: outside.value + 1.0)
    assert [float(v) for v in strategy.experimental_local_results(out)] == [6.0, 6.0]
    outside.assign(7.0)
    out = strategy.run(lambda: outside.value + 1.0)
    assert [float(v) for v in strategy.experimental_local_results(out)] == [8.0, 8.0]
    with pytest.raises(ValueError, match="created outside `strategy.scope\\(\\)`"):
        strategy.run(lambda: outside.assign(1.0))


def test_outputs_keep_structure_and_constants():
    strategy = kd.MirroredStrategy(cpus(2))
    out = strategy.run(lambda: {"a": 1.0, "name": "x", "none": None})
    assert out["name"] == "x" and out["none"] is None
    assert [float(v) for v in strategy.experimental_local_results(out["a"])] == [1.0, 1.0]


def test_donated_state_survives_a_shared_buffer():
    strategy = kd.MirroredStrategy(cpus(2))
    with strategy.scope():
        a = keras.Variable(np.ones((2,), "float32"))
        b = keras.Variable(np.zeros((2,), "float32"))
    b.assign(a)  # now both hold the same buffer
    strategy.run(lambda: a.assign_add(a.value))
    np.testing.assert_array_equal(a.numpy(), [2.0, 2.0])
    np.testing.assert_array_equal(b.numpy(), [1.0, 1.0])


@pytest.mark.parametrize("as_function", [False, True], ids=["run", "kd.function"])
@pytest.mark.parametrize("devices", [1, 2])
def test_a_program_called_again_sees_every_write_made_between_its_calls(as_function, devices):
    # A program called again on the arrays its last call stored skips their checks;
    # a write between its calls (a new value, or another variable's very array) must not.
    strategy = kd.MirroredStrategy(cpus(devices))
    with strategy.scope():
        a = keras.Variable(np.ones((2,), "float32"), aggregation="mean")
        b = keras.Variable(np.full((2,), 10.0, "float32"), aggregation="mean")

    def replica_step():
        a.assign_add(np.ones((2,), "float32"))
        b.assign_add(np.ones((2,), "float32"))
        return a.value + b.value

    def step():
        return strategy.run(replica_step)

    step = kd.function(step) if as_function else step

    def total():
        return [float(np.asarray(v)[0]) for v in strategy.experimental_local_results(step())]

    assert total() == [13.0] * devices  # a 2, b 11
    assert total() == [15.0] * devices  # a 3, b 12: the arrays it left
    b.assign(a)  # b now holds a's very array: donation needs a copy of it
    assert total() == [8.0] * devices  # a 4, b 4
    a.assign(np.full((2,), 7.0, "float32"))
    assert total() == [13.0] * devices  # a 8, b 5
    np.testing.assert_array_equal(a.numpy(), [8.0, 8.0])
    np.testing.assert_array_equal(b.numpy(), [5.0, 5.0])


@pytest.mark.stress
def test_two_thousand_compiled_steps_with_collectives_do_not_abort():
    # Overlapping collective executions abort on simulated CPU devices (docs/architecture.md).
    strategy = kd.MirroredStrategy(cpus(4))
    with strategy.scope():
        w = keras.Variable(np.zeros((64,), "float32"), aggregation="sum")

    def step(x):
        total = kd.get_replica_context().all_reduce("SUM", x)
        w.assign_add(total * 0.0 + 1.0)
        return total

    x = strategy.experimental_distribute_values_from_function(
        lambda c: np.full((64,), c.replica_id_in_sync_group, "float32")
    )
    for _ in range(2000):
        out = strategy.run(step, args=(x,))
    jax.block_until_ready(strategy.experimental_local_results(out))
    np.testing.assert_array_equal(strategy.experimental_local_results(out)[0], np.full(64, 6.0))
    # SUM aggregation adds every replica's 1.0 each step.
    np.testing.assert_array_equal(w.numpy(), np.full((64,), 8000.0))


def test_large_gradients_join_one_all_reduce_after_compilation():
    # Small gradients share a packed buffer; large ones are operands of the same
    # psum, which XLA compiles into a single all-reduce.
    strategy = kd.MirroredStrategy(cpus(4))
    with strategy.scope():
        weights = [keras.Variable(np.ones((300, 300), "float32")) for _ in range(3)]
        weights += [keras.Variable(np.ones((5,), "float32")) for _ in range(20)]
        optimizer = keras.optimizers.SGD(0.1)
        optimizer.build(weights)

    def step(x):
        loss_fn = lambda: sum(keras.ops.sum(w) * x for w in weights)  # noqa: E731
        _, grads = kd.value_and_grad(loss_fn, weights)()
        optimizer.apply_gradients(zip(grads, weights))

    x = strategy.experimental_distribute_values_from_function(lambda ctx: np.float32(1.0))
    strategy.run(step, args=(x,))
    (entry,) = _entries(strategy)
    lowered = entry.lowered.as_text()
    # One packed buffer of the 20 small gradients, and the 3 large ones.
    assert lowered.count("stablehlo.all_reduce") == 4
    assert "tensor<100xf32>" in lowered
    compiled = entry.compiled.as_text()
    assert len([line for line in compiled.splitlines() if " all-reduce(" in line]) == 1
    # Every replica's gradient of sum(w) is 1, summed over 4 replicas.
    np.testing.assert_allclose(weights[0].numpy(), np.full((300, 300), 1 - 0.4), rtol=1e-6)


def _two_cores_a_replica():
    topology = kd.tpu.experimental.Topology.from_devices(jax.devices("cpu")[:4])
    assignment = kd.tpu.experimental.DeviceAssignment.build(
        topology, computation_shape=[2, 1, 1, 1], num_replicas=2
    )
    return kd.MirroredStrategy(experimental_device_assignment=assignment)


@pytest.mark.parametrize(
    "make_strategy",
    [lambda: kd.MirroredStrategy(cpus(4)), _two_cores_a_replica],
    ids=["4-replicas", "2-cores-a-replica"],
)
def test_large_outputs_are_their_programs_shards_and_feed_back_as_stacked_ones(make_strategy):
    # On CPU a replica's output of 1 MiB or more leaves the program as its rows of
    # one joined array: each shard is a component as it is (cutting one out of a
    # stacked array is a copy). Fed back to `run` or `reduce`, it is stacked then.
    strategy = make_strategy()
    n = strategy.num_replicas_in_sync
    rows = (np.arange(600 * 500) % 97).astype("float32").reshape(600, 500)  # 1.2 MB
    value = strategy.experimental_distribute_values_from_function(
        lambda ctx: rows + ctx.replica_id_in_sync_group
    )

    def step(x):
        ctx = kd.get_replica_context()
        return {"large": x * 2.0, "summed": ctx.all_reduce("SUM", x), "small": x[0, :4]}

    out = strategy.run(step, args=(value,))
    (entry,) = _entries(strategy)
    lowered = entry.lowered.as_text()
    assert f"tensor<{n * 600}x500xf32>" in lowered  # joined: every replica's 600 rows
    assert f"tensor<{n}x4xf32>" in lowered  # small outputs stay stacked
    large = strategy.experimental_local_results(out["large"])
    assert [c.devices() for c in large] == [{d} for d in strategy.extended.local_devices]
    for i, component in enumerate(large):
        np.testing.assert_array_equal(component, (rows + i) * 2.0)
    for component in strategy.experimental_local_results(out["summed"]):
        np.testing.assert_array_equal(component, rows * n + sum(range(n)))
    np.testing.assert_array_equal(
        strategy.experimental_local_results(out["small"])[-1], rows[0, :4] + n - 1
    )
    again = strategy.run(lambda x: x + 1.0, args=(out["large"],))
    for i, component in enumerate(strategy.experimental_local_results(again)):
        np.testing.assert_array_equal(component, (rows + i) * 2.0 + 1.0)
    total = sum((rows + i) * 2.0 for i in range(n))
    np.testing.assert_array_equal(strategy.reduce("SUM", out["large"], axis=None), total)
    np.testing.assert_allclose(
        strategy.reduce("MEAN", out["large"], axis=0), total.sum(0) / (n * 600), rtol=1e-6
    )
    assert out["large"].stacked.shape == (n, 600, 500)


@pytest.fixture
def eagerly():
    kd.config.run_functions_eagerly(True)
    yield
    kd.config.run_functions_eagerly(False)


def test_eager_replicas_of_a_central_storage_update_its_variable_step_after_step(eagerly):
    # The update, reduced onto the replicas' devices, met the centrally stored value
    # in the second step ("incompatible devices").
    strategy = kd.experimental.CentralStorageStrategy(cpus(4))
    with strategy.scope():
        w = keras.Variable(np.ones((2,), "float32"), aggregation="mean")

    def replica_fn():
        w.assign_sub(0.1 * w.value)
        return w.value

    firsts = [
        float(strategy.experimental_local_results(strategy.run(replica_fn))[0][0]) for _ in range(3)
    ]
    np.testing.assert_allclose(firsts, [0.9, 0.81, 0.729], rtol=1e-6)


def test_an_eager_replica_adds_a_merge_call_result_to_its_own_values(eagerly):
    # The merge's reduction lives on the first device; each replica gets its copy.
    strategy = kd.MirroredStrategy(cpus(4))
    x = np.arange(32, dtype="float32").reshape(8, 4) / 10

    def replica_fn(batch):
        total = kd.get_replica_context().merge_call(
            lambda s, v: s.reduce("SUM", v, axis=None), args=(keras.ops.sum(batch),)
        )
        return total + keras.ops.sum(batch)

    (batch,) = strategy.experimental_distribute_dataset([x])
    results = strategy.experimental_local_results(strategy.run(replica_fn, args=(batch,)))
    expected = [x.sum() + x[2 * i : 2 * i + 2].sum() for i in range(4)]
    np.testing.assert_allclose([float(r) for r in results], expected, rtol=1e-6)
