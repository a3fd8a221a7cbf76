"""Bad arguments fail early, with the fix in the message and what was received.

Each case used to fail deep inside JAX or Python (an MLIR shape error, a
``ZeroDivisionError``, "'int' object is not iterable"); these tests pin the
exception type and the key parts of the message that replaced it.
"""

import jax
import jax.numpy as jnp
import keras
import numpy as np
import pytest
from conftest import cpus

import keras_dist as kd


# ------------------------------------------------------------ 0-row batches
@pytest.mark.parametrize("n", [1, 2])
def test_distributed_dataset_rejects_a_global_batch_of_zero_rows(engine, n):
    strategy = kd.MirroredStrategy(cpus(n))
    dataset = strategy.experimental_distribute_dataset([np.zeros((0, 3))])
    with pytest.raises(ValueError, match=r"global batch has 0 rows") as info:
        for batch in dataset:
            strategy.run(lambda x: x, args=(batch,))
    assert "Received: shapes=[(0, 3)]" in str(info.value)


def test_partial_batch_smaller_than_the_replica_count_still_splits():
    # 1 row on 2 replicas gives one replica 0 rows: legitimate, not an empty batch.
    strategy = kd.MirroredStrategy(cpus(2))
    dataset = strategy.experimental_distribute_dataset([np.ones((1, 3))])
    (batch,) = list(dataset)
    shapes = [c.shape for c in strategy.experimental_local_results(batch)]
    assert shapes == [(1, 3), (0, 3)]


class _EmptyBatches(keras.utils.PyDataset):
    def __len__(self):
        return 1

    def __getitem__(self, index):
        return np.zeros((0, 3), "float32"), np.zeros((0, 1), "float32")


def _model(strategy):
    with strategy.scope():
        model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
        model.compile("sgd", "mse")
    return model


@pytest.mark.parametrize("n", [1, 2])
def test_fit_rejects_an_empty_batch_from_a_py_dataset(n):
    model = _model(kd.MirroredStrategy(cpus(n)))
    with pytest.raises(ValueError, match=r"`model.fit` received a batch with 0 rows") as info:
        model.fit(_EmptyBatches(), epochs=1, verbose=0)
    assert "Received: batch shapes=[(0, 3), (0, 1)]" in str(info.value)


def test_fit_rejects_an_empty_batch_from_a_generator():
    model = _model(kd.MirroredStrategy(cpus(2)))

    def batches():
        yield np.ones((4, 3), "float32"), np.ones((4, 1), "float32")
        yield np.zeros((0, 3), "float32"), np.zeros((0, 1), "float32")

    with pytest.raises(ValueError, match=r"0 rows.*skip empty batches"):
        model.fit(batches(), epochs=1, steps_per_epoch=2, shuffle=False, verbose=0)


def test_evaluate_and_predict_reject_an_empty_batch():
    model = _model(kd.MirroredStrategy(cpus(2)))
    with pytest.raises(ValueError, match=r"`model.evaluate`.* 0 rows"):
        model.evaluate(_EmptyBatches(), verbose=0)
    with pytest.raises(ValueError, match=r"`model.predict` received a batch with 0 rows"):
        model.predict(_EmptyBatches(), verbose=0)


# ------------------------------------------------------- reduce/gather axis
def _rank_1_values(strategy):
    return strategy.run(lambda: jnp.ones((2,)))


@pytest.mark.parametrize("axis", [5, 1, -2])
def test_reduce_rejects_an_axis_out_of_range(engine, axis):
    strategy = kd.MirroredStrategy(cpus(2))
    with pytest.raises(ValueError, match=r"axis out of range.*\[-1, 1\).*rank 1") as info:
        strategy.reduce("SUM", _rank_1_values(strategy), axis=axis)
    assert f"Received: axis={axis}, per-replica rank=1" in str(info.value)


@pytest.mark.parametrize("axis", ["0", 0.0, True])
def test_reduce_rejects_an_axis_that_is_not_an_integer(axis):
    strategy = kd.MirroredStrategy(cpus(2))
    with pytest.raises(TypeError, match=r"`axis` to be an integer \(or None\)") as info:
        strategy.reduce("SUM", _rank_1_values(strategy), axis=axis)
    assert f"Received: axis={axis!r}" in str(info.value)


def test_reduce_of_scalars_with_an_axis_says_to_pass_none():
    strategy = kd.MirroredStrategy(cpus(2))
    value = strategy.run(lambda: jnp.float32(1.0))
    with pytest.raises(ValueError, match=r"scalars \(rank 0\).*axis=None"):
        strategy.reduce("SUM", value, axis=0)


def test_reduce_accepts_negative_and_numpy_axes(engine):
    strategy = kd.MirroredStrategy(cpus(2))
    value = _rank_1_values(strategy)
    assert float(strategy.reduce("SUM", value, axis=-1)) == 4.0
    assert float(strategy.reduce("MEAN", value, axis=np.int64(0))) == 1.0


def test_gather_rejects_a_bad_axis(engine):
    strategy = kd.MirroredStrategy(cpus(2))
    value = _rank_1_values(strategy)
    with pytest.raises(ValueError, match=r"`strategy.gather` got an axis out of range"):
        strategy.gather(value, axis=1)
    with pytest.raises(TypeError, match=r"`axis` to be an integer: .*Received: axis=None"):
        strategy.gather(value, axis=None)
    assert strategy.gather(value, axis=-1).shape == (4,)


# ----------------------------------------------------- strategy constructors
def test_mirrored_strategy_rejects_a_device_count():
    with pytest.raises(TypeError, match=r"`devices` must be a list of device strings") as info:
        kd.MirroredStrategy(3)
    message = str(info.value)
    assert "jax.devices()[:3]" in message
    assert "['/cpu:0', '/cpu:1', ...]" in message
    assert message.endswith("Received: devices=3")


def test_mirrored_strategy_rejects_a_bad_item():
    with pytest.raises(TypeError, match=r"`devices\[1\]` must be a device string"):
        kd.MirroredStrategy(["/cpu:0", 1])


def test_one_device_strategy_rejects_a_device_index():
    with pytest.raises(TypeError, match=r"`device` must be a device string") as info:
        kd.OneDeviceStrategy(1)
    assert "'/cpu:1' or jax.devices()[1]" in str(info.value)
    assert str(info.value).endswith("Received: device=1")


def test_central_storage_strategy_names_the_bad_argument():
    with pytest.raises(TypeError, match=r"jax.devices\(\)\[:2\]") as info:
        kd.experimental.CentralStorageStrategy(2)
    assert str(info.value).endswith("Received: compute_devices=2")
    with pytest.raises(TypeError, match=r"`parameter_device` must be a device string") as info:
        kd.experimental.CentralStorageStrategy(cpus(2), parameter_device=0)
    assert str(info.value).endswith("Received: parameter_device=0")


def test_strategies_still_take_jax_devices():
    strategy = kd.MirroredStrategy(jax.devices("cpu")[:3])
    assert strategy.num_replicas_in_sync == 3


# ------------------------------------------------------ CommunicationOptions
def test_communication_options_report_the_implementation_received():
    with pytest.raises(ValueError, match=r"AUTO, RING or NCCL") as info:
        kd.experimental.CommunicationOptions(implementation="foo")
    assert str(info.value).endswith("Received: implementation='foo'")
    with pytest.raises(TypeError, match=r"Received: implementation=3$"):
        kd.experimental.CommunicationOptions(implementation=3)


def test_communication_options_reject_wrong_types():
    with pytest.raises(TypeError, match=r"Received: bytes_per_pack='1k'"):
        kd.experimental.CommunicationOptions(bytes_per_pack="1k")
    with pytest.raises(TypeError, match=r"Received: timeout_seconds='5'"):
        kd.experimental.CommunicationOptions(timeout_seconds="5")


# ------------------------------------------------------- NumpyDataset.batch
@pytest.mark.parametrize("batch_size", [0, -1])
def test_numpy_dataset_rejects_a_batch_size_below_one(batch_size):
    strategy = kd.MirroredStrategy(cpus(2))
    dataset = strategy.experimental_make_numpy_dataset(np.arange(4))
    with pytest.raises(ValueError, match=r"batch_size must be a positive integer") as info:
        dataset.batch(batch_size)
    assert str(info.value).endswith(f"Received: batch_size={batch_size}")


@pytest.mark.parametrize("batch_size", [2.5, "2", None])
def test_numpy_dataset_rejects_a_batch_size_that_is_not_an_integer(batch_size):
    dataset = kd.MirroredStrategy(cpus(2)).experimental_make_numpy_dataset(np.arange(4))
    with pytest.raises(TypeError, match=r"batch_size must be a positive integer") as info:
        dataset.batch(batch_size)
    assert str(info.value).endswith(f"Received: batch_size={batch_size!r}")
    assert [b.tolist() for b in dataset.batch(np.int64(3))] == [[0, 1, 2], [3]]


# ------------------------------------------- steps inside a JAX loop's body
_IN_A_LOOP = r"inside a JAX transformation.*Python `for` loop inside a `@kd.function`"


def _counter_and_step(strategy):
    with strategy.scope():
        counter = keras.Variable(0.0, aggregation="mean")

    def step():
        counter.assign_add(1.0)
        return counter.value * 1.0

    return counter, step


def test_a_step_in_a_jax_loop_body_raises_rather_than_losing_its_updates(engine):
    # The body is traced once: TF's tf.range loop gave 6.0 and a counter of 3, this
    # gave 3.0 and 1 (or crashed deep in JAX inside a kd.function).
    strategy = kd.MirroredStrategy(cpus(2))
    counter, step = _counter_and_step(strategy)

    def body(i, total):
        return total + strategy.reduce("MEAN", strategy.run(step), axis=None)

    @kd.function
    def loop_in_function():
        return keras.ops.fori_loop(0, 3, body, 0.0)

    @kd.function
    def python_loop():
        total = 0.0
        for _ in range(3):
            total = body(None, total)
        return total

    for looped in (lambda: keras.ops.fori_loop(0, 3, body, 0.0), loop_in_function):
        with pytest.raises(RuntimeError, match=_IN_A_LOOP):
            looped()
        assert float(counter.value) == 0.0  # nothing half-applied
    with pytest.raises(RuntimeError, match=_IN_A_LOOP):
        jax.jit(lambda: strategy.run(step))()
    # The fix the message names: TF's numbers.
    assert float(python_loop()) == 6.0
    assert float(counter.value) == 3.0


def test_next_in_a_jax_loop_body_raises_rather_than_repeating_a_batch(engine):
    # TF: 1 + 2 + 3 (three batches); the loop's one trace gave batch 1 three times.
    strategy = kd.MirroredStrategy(cpus(2))
    batches = [np.full((2,), i, "float32") for i in range(1, 5)]
    iterator = iter(strategy.experimental_distribute_dataset(batches))

    def body(i, total):
        element = next(iterator)
        return total + strategy.reduce("SUM", strategy.run(jnp.sum, args=(element,)), axis=None)

    @kd.function
    def loop(iterator):
        def read_in_body(i, total):
            element = next(iterator)
            summed = strategy.run(jnp.sum, args=(element,))
            return total + strategy.reduce("SUM", summed, axis=None)

        return keras.ops.fori_loop(0, 3, read_in_body, 0.0)

    with pytest.raises(RuntimeError, match=_IN_A_LOOP):
        loop(iterator)
    with pytest.raises(RuntimeError, match=_IN_A_LOOP):
        keras.ops.fori_loop(0, 3, body, 0.0)
    # No batch was lost to the refused calls.
    first = strategy.experimental_local_results(next(iterator))
    assert [float(x[0]) for x in first] == [1.0, 1.0]


# ------------------------------------------------- input options, numpy rows
@pytest.mark.parametrize("options", ["bad", {"experimental_fetch_to_device": False}, 3])
def test_input_options_of_another_type_name_kd_input_options(options):
    strategy = kd.MirroredStrategy(cpus(2))
    calls = {
        "experimental_distribute_dataset": lambda: strategy.experimental_distribute_dataset(
            [np.ones((2, 3))], options=options
        ),
        "distribute_datasets_from_function": lambda: strategy.distribute_datasets_from_function(
            lambda context: [np.ones((1, 3))], options=options
        ),
    }
    for method, call in calls.items():
        with pytest.raises(TypeError) as info:
            call()
        message = str(info.value)
        assert f"`{method}` takes `options=kd.InputOptions(...)`" in message
        assert f"Received: options={options!r} of type {type(options).__name__}" in message


def test_input_options_still_take_kd_input_options_and_none():
    strategy = kd.MirroredStrategy(cpus(2))
    for options in (None, kd.InputOptions()):
        dataset = strategy.experimental_distribute_dataset([np.ones((2, 3))], options=options)
        (batch,) = list(dataset)
        assert [c.shape for c in strategy.experimental_local_results(batch)] == [(1, 3)] * 2


@pytest.mark.parametrize(
    "arrays, received",
    [
        ((np.ones((10, 2)), np.ones((9, 1))), "Received: rows=10 at [0], rows=9 at [1]"),
        ({"x": np.ones(4), "y": np.ones((5, 2))}, "Received: rows=4 at ['x'], rows=5 at ['y']"),
    ],
)
def test_numpy_dataset_of_arrays_with_different_row_counts_fails_when_made(arrays, received):
    strategy = kd.MirroredStrategy(cpus(2))
    with pytest.raises(ValueError, match="the same number of rows") as info:
        strategy.experimental_make_numpy_dataset(arrays)
    assert received in str(info.value)


def test_numpy_dataset_of_a_scalar_says_to_pass_arrays_of_rows():
    strategy = kd.MirroredStrategy(cpus(2))
    with pytest.raises(ValueError, match="rank 1 or more") as info:
        strategy.experimental_make_numpy_dataset((np.ones(3), np.float32(2.0)))
    assert "Received: a scalar at [1]" in str(info.value)


# ---------------------------------------------------------- cross-device ops
def test_reduction_to_a_device_this_host_lacks_fails_when_the_strategy_is_made():
    ops = kd.ReductionToOneDevice(f"/cpu:{len(jax.devices('cpu'))}")
    with pytest.raises(ValueError, match="does not exist on this host") as info:
        kd.MirroredStrategy(cpus(2), cross_device_ops=ops)
    message = str(info.value)
    assert "Available devices: ['/job:localhost/replica:0/task:0/device:CPU:0'" in message
    assert f"Received: reduce_to_device='/cpu:{len(jax.devices('cpu'))}'" in message


def test_reduction_to_one_device_rejects_a_bad_device_name_when_made():
    with pytest.raises(ValueError, match="Received: reduce_to_device='cpu9'"):
        kd.ReductionToOneDevice("cpu9")
    with pytest.raises(TypeError, match="Received: reduce_to_device=9"):
        kd.ReductionToOneDevice(9)
    with pytest.raises(TypeError, match="Received: accumulation_fn='sum'"):
        kd.ReductionToOneDevice(accumulation_fn="sum")


def test_reduction_to_a_device_of_this_host_reduces_there():
    strategy = kd.MirroredStrategy(cpus(2), cross_device_ops=kd.ReductionToOneDevice("/cpu:3"))
    value = strategy.run(lambda: kd.get_replica_context().replica_id_in_sync_group + 1.0)
    assert float(strategy.reduce("SUM", value, axis=None)) == 3.0


@pytest.mark.parametrize("ops", [kd.NcclAllReduce, kd.HierarchicalCopyAllReduce])
def test_all_reduce_ops_name_a_bad_num_packs(ops):
    with pytest.raises(TypeError, match="Received: num_packs='2'"):
        ops(num_packs="2")
    with pytest.raises(ValueError, match="Received: num_packs=-1"):
        ops(num_packs=-1)
