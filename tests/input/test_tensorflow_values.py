"""TensorFlow values in a ported program: tensors taken as arrays, tf.data options honoured.

TensorFlow is optional. The first tests use stand-ins that look to keras_dist as
TF's values do (their type's module, ``__array__``, ``options()``), so the
suite checks the rules without TF; the last ones use TF itself when it is
installed (here they ran against TF 2.21).
"""

import os
import subprocess
import sys
import types

import numpy as np
import pytest
from conftest import cpus

import keras_dist as kd


class FakeTensor:
    """Looks like ``tf.Tensor`` to keras_dist: TF's module, NumPy through ``__array__``."""

    __module__ = "tensorflow.python.framework.ops"

    def __init__(self, value):
        self._value = np.asarray(value)

    def __array__(self, dtype=None, copy=None):
        return self._value if dtype is None else self._value.astype(dtype)

    def __hash__(self):
        raise TypeError("Tensor is unhashable. Instead, use tensor.ref() as the key.")


class FakeTFDataset:
    """Looks like a ``tf.data.Dataset`` with an ``auto_shard_policy`` option."""

    __module__ = "tensorflow.python.data.ops.dataset_ops"

    def __init__(self, rows, policy):
        self.rows = rows
        self.policy = policy

    def options(self):
        policy = types.SimpleNamespace(name=self.policy)
        return types.SimpleNamespace(
            experimental_distribute=types.SimpleNamespace(auto_shard_policy=policy)
        )

    def __iter__(self):
        return iter(self.rows)


class FakeTFBatches:
    """Looks like a batched ``tf.data.Dataset``: ``element_spec`` knows the batch size or not."""

    __module__ = "tensorflow.python.data.ops.dataset_ops"

    def __init__(self, batches, drop_remainder):
        self.batches = batches
        shape = types.SimpleNamespace(is_fully_defined=lambda: drop_remainder)
        self.element_spec = types.SimpleNamespace(shape=shape)

    def __iter__(self):
        return iter(self.batches)


@pytest.mark.parametrize("drop_remainder, steps", [(True, 2), (False, 3)])
def test_a_tf_data_batch_size_known_ahead_ends_the_input_at_a_short_round(drop_remainder, steps):
    # TF 2.21, 4 replicas: range(22).batch(2, drop_remainder=True) gives 2 steps, and
    # batch(2) 3 (the third with an empty batch), as the test with TF below checks.
    strategy = kd.MirroredStrategy(cpus(4))
    batches = [np.arange(i, i + 2) for i in range(0, 22, 2)]
    dataset = strategy.distribute_datasets_from_function(
        lambda ctx: FakeTFBatches(batches, drop_remainder)
    )
    assert len(list(dataset)) == steps


def test_tensors_are_arrays_in_run_reduce_and_value_functions():
    strategy = kd.MirroredStrategy(cpus(4))
    values = strategy.experimental_distribute_values_from_function(
        lambda ctx: FakeTensor([float(ctx.replica_id_in_sync_group)])
    )
    assert [float(v[0]) for v in strategy.experimental_local_results(values)] == [0, 1, 2, 3]
    doubled = strategy.run(lambda x, scale: x * scale, args=(values, FakeTensor(2.0)))
    assert float(strategy.reduce("SUM", doubled, axis=None)[0]) == 12.0
    assert float(strategy.reduce("MEAN", FakeTensor(5.0), axis=None)) == 5.0
    np.testing.assert_allclose(strategy.gather(values, axis=0), [0.0, 1.0, 2.0, 3.0])


def test_batches_of_tensors_are_split_like_arrays():
    strategy = kd.MirroredStrategy(cpus(4))
    batches = [
        (FakeTensor(np.arange(8, dtype="float32")), FakeTensor(np.arange(8, dtype="int32"))),
        (FakeTensor(np.arange(2, dtype="float32")), FakeTensor(np.arange(2, dtype="int32"))),
    ]
    sizes = []
    for _, y in strategy.experimental_distribute_dataset(batches):
        sizes.append([len(c) for c in strategy.experimental_local_results(y)])
    assert sizes == [[2, 2, 2, 2], [1, 1, 0, 0]]


_ONE_REPLICA = {
    "default": kd.get_strategy,
    "one_device": lambda: kd.OneDeviceStrategy("/cpu:0"),
    "mirrored_one_device": lambda: kd.MirroredStrategy(cpus(1)),
}


def _one_replica_epochs(strategy, dataset):
    """Each step's ``strategy.run`` result through both distribution methods, as NumPy."""

    def step(x, y):
        return x * 2.0 + y

    def epoch(distributed):
        assert distributed.element_spec is not None
        return [np.asarray(strategy.run(step, args=element)) for element in distributed]

    return (
        epoch(strategy.experimental_distribute_dataset(dataset)),
        epoch(strategy.distribute_datasets_from_function(lambda ctx: dataset)),
    )


@pytest.mark.parametrize("name", list(_ONE_REPLICA))
def test_batches_of_tensors_reach_a_one_replica_strategy_as_arrays(name):
    # The default strategy handed tf.data batches on as they were: their dtype
    # (tf.float32) was no NumPy dtype, and its `element_spec` raised.
    x = np.arange(12, dtype="float32").reshape(6, 2)
    y = np.ones((6, 1), "float32")
    batches = [(FakeTensor(x[:4]), FakeTensor(y[:4])), (FakeTensor(x[4:]), FakeTensor(y[4:]))]
    expected = [x[:4] * 2.0 + y[:4], x[4:] * 2.0 + y[4:]]  # one device, no strategy
    strategy = _ONE_REPLICA[name]()
    for steps in _one_replica_epochs(strategy, batches):
        assert len(steps) == 2
        for got, want in zip(steps, expected):
            np.testing.assert_array_equal(got, want)


def test_auto_shard_reads_a_tf_data_option():
    rows = list(range(8))
    whole = kd.data.auto_shard(FakeTFDataset(rows, "OFF"), num_shards=2, index=1)
    assert list(whole) == rows
    data = kd.data.auto_shard(FakeTFDataset(rows, "DATA"), num_shards=2, index=1)
    assert list(data) == [1, 3, 5, 7]


def test_int64_input_is_said_once_and_kept_with_x64():
    code = """
import os, warnings
os.environ["KERAS_BACKEND"] = "jax"
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2"
import numpy as np, jax, keras_dist as kd
strategy = kd.MirroredStrategy(["/cpu:0", "/cpu:1"])
batches = [np.arange(4, dtype="int64"), np.arange(4, dtype="int64")]
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    dtypes = [str(strategy.experimental_local_results(b)[0].dtype)
              for b in strategy.experimental_distribute_dataset(batches)]
said = [str(w.message) for w in caught if "x64" in str(w.message)]
print(dtypes, len(said), "JAX_ENABLE_X64=1" in (said or [""])[0])
"""

    for x64, expected in (("0", "['int32', 'int32'] 1 True"), ("1", "['int64', 'int64'] 0 False")):
        env = dict(os.environ, JAX_ENABLE_X64=x64)
        result = subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env
        )
        assert result.returncode == 0, result.stderr[-2000:]
        assert result.stdout.strip().splitlines()[-1] == expected


# ------------------------------------------------------------ with TensorFlow
def test_tf_data_pipeline_and_tf_tensors_with_tensorflow():
    tf = pytest.importorskip("tensorflow")  # optional: cross-checks the stand-ins above
    strategy = kd.MirroredStrategy(cpus(4))
    x = np.arange(20, dtype="float32").reshape(10, 2)
    dataset = tf.data.Dataset.from_tensor_slices((x, np.arange(10, dtype="int32"))).batch(8)
    splits = [
        [np.asarray(c).tolist() for c in strategy.experimental_local_results(y)]
        for _, y in strategy.experimental_distribute_dataset(dataset)
    ]
    assert splits == [[[0, 1], [2, 3], [4, 5], [6, 7]], [[8], [9], [], []]]  # TF's split
    values = strategy.experimental_distribute_values_from_function(
        lambda ctx: tf.constant([float(ctx.replica_id_in_sync_group)])
    )
    assert float(strategy.reduce("SUM", values, axis=None)[0]) == 6.0
    out = strategy.run(lambda a: a * 2, args=(tf.constant(3.0),))
    assert [float(v) for v in strategy.experimental_local_results(out)] == [6.0] * 4
    options = tf.data.Options()
    options.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.OFF
    unbatched = dataset.unbatch().with_options(options)
    assert len(list(kd.data.auto_shard(unbatched, num_shards=2, index=1))) == 10


@pytest.mark.parametrize("drop_remainder, steps", [(True, 2), (False, 3)])
def test_tf_data_static_shapes_in_datasets_from_function_with_tensorflow(drop_remainder, steps):
    tf = pytest.importorskip("tensorflow")
    strategy = kd.MirroredStrategy(cpus(4))
    dataset = strategy.distribute_datasets_from_function(
        lambda ctx: tf.data.Dataset.range(22).batch(2, drop_remainder=drop_remainder)
    )
    epoch = [
        [np.asarray(v).tolist() for v in strategy.experimental_local_results(x)] for x in dataset
    ]
    assert len(epoch) == steps
    assert epoch[1] == [[8, 9], [10, 11], [12, 13], [14, 15]]
    if not drop_remainder:
        assert epoch[2] == [[16, 17], [18, 19], [20, 21], []]
    scalars = strategy.distribute_datasets_from_function(lambda ctx: tf.data.Dataset.range(6))
    assert [[int(v) for v in strategy.experimental_local_results(x)] for x in scalars] == [
        [0, 1, 2, 3]
    ]


@pytest.mark.parametrize("name", list(_ONE_REPLICA))
def test_tf_data_on_a_one_replica_strategy_with_tensorflow(name):
    tf = pytest.importorskip("tensorflow")
    x = np.arange(12, dtype="float32").reshape(6, 2)
    y = np.ones((6, 1), "float32")
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(4)
    expected = [(bx * 2.0 + by).numpy() for bx, by in dataset]  # TF's own values
    strategy = _ONE_REPLICA[name]()
    for steps in _one_replica_epochs(strategy, dataset):
        assert len(steps) == 2
        for got, want in zip(steps, expected):
            np.testing.assert_array_equal(got, want)
