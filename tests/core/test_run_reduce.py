"""run, reduce and gather (from TF's strategy_test_lib.py and friends)."""

import jax
import jax.numpy as jnp
import keras
import numpy as np
import pytest
from conftest import cpus

import keras_dist as kd


def _local(strategy, value):
    """The replicas' components of ``value`` as Python numbers or lists."""
    return [np.asarray(x).tolist() for x in strategy.experimental_local_results(value)]


def _replica_id():
    return kd.get_replica_context().replica_id_in_sync_group


def _uneven(strategy, length, dtype="float32"):
    """A PerReplica whose component ``i`` has ``length(i)`` zeros.

    Components of different shapes always take the eager engine (one compiled
    program cannot take them): that is how replicas return values of different
    shapes, as ``[i] * (i + 1)`` in TF's tests, under either engine setting.
    """
    return strategy.experimental_distribute_values_from_function(
        lambda ctx: np.zeros((length(ctx.replica_id_in_sync_group),), dtype)
    )


# ------------------------------------------------------- 10. OneDevice run
def test_one_device_run(engine):
    strategy = kd.OneDeviceStrategy("/cpu:0")
    out1 = strategy.run(lambda: 4.0)
    assert _local(strategy, out1) == [4.0]
    out2 = strategy.run(lambda x: {"a": x * 2, "b": x * x}, args=(out1,))
    assert _local(strategy, out2["a"]) == [8.0]
    assert _local(strategy, out2["b"]) == [16.0]
    out3 = strategy.run(lambda b, a: a + 2 * b + 2, kwargs=out2)
    assert _local(strategy, out3) == [42.0]


# ---------------------------------------------------- 11. run with replica ids
@pytest.mark.parametrize("n", [1, 2, 4])
def test_run_replica_id_chain(engine, n):
    strategy = kd.MirroredStrategy(cpus(n))
    out1 = strategy.run(lambda: _replica_id() + 1)
    out2 = strategy.run(lambda x: {"a": x * 2, "b": x * x}, args=(out1,))
    out3 = strategy.run(lambda b, a: a + 2 * b + 2, kwargs=out2)
    ids = range(1, n + 1)
    assert _local(strategy, out1) == list(ids)
    assert _local(strategy, out2["a"]) == [2 * i for i in ids]
    assert _local(strategy, out2["b"]) == [i * i for i in ids]
    assert _local(strategy, out3) == [2 * i + 2 * i * i + 2 for i in ids]
    if n == 2:  # TF's numbers
        assert (_local(strategy, out1), _local(strategy, out3)) == ([1, 2], [6, 14])
        assert (_local(strategy, out2["a"]), _local(strategy, out2["b"])) == ([2, 4], [1, 4])


def test_run_with_one_device_mirrored_matches_one_device(engine):
    strategy = kd.MirroredStrategy(cpus(1))
    out1 = strategy.run(lambda: 4.0)
    out2 = strategy.run(lambda x: {"a": x * 2, "b": x * x}, args=(out1,))
    out3 = strategy.run(lambda b, a: a + 2 * b + 2, kwargs=out2)
    assert _local(strategy, out3) == [42.0]


# ---------------------------------------------------- 12. replica ids, errors
@pytest.mark.parametrize("n", [2, 4, 8])
def test_each_replica_id_is_seen_once_on_its_device(engine, n):
    strategy = kd.MirroredStrategy(cpus(n))
    with strategy.scope():
        out = strategy.extended.call_for_each_replica(lambda: jnp.asarray(_replica_id()))
    components = strategy.experimental_local_results(out)
    assert sorted(int(c) for c in components) == list(range(n))
    assert [int(c) for c in components] == list(range(n))
    devices = jax.devices("cpu")[:n]
    assert [c.devices() for c in components] == [{d} for d in devices]


class _TestException(Exception):
    pass


def _raise_exception_fn(_=None):
    raise _TestException()


def _merge_raises_fn():
    kd.get_replica_context().merge_call(_raise_exception_fn)


def _call_raises_fn(dist):
    dist.extended.call_for_each_replica(_raise_exception_fn)


def _merge_call_raises_fn():
    kd.get_replica_context().merge_call(_call_raises_fn)


def _call_merge_raises_fn(dist):
    dist.extended.call_for_each_replica(_merge_raises_fn)


def _merge_call_merge_raises_fn():
    kd.get_replica_context().merge_call(_call_merge_raises_fn)


@pytest.mark.parametrize(
    "fn",
    [_raise_exception_fn, _merge_raises_fn, _merge_call_raises_fn, _merge_call_merge_raises_fn],
    ids=["fn", "merge_fn", "call_in_merge", "merge_in_call_in_merge"],
)
@pytest.mark.parametrize("n", [1, 2])
def test_exceptions_reach_the_caller_unchanged(engine, n, fn):
    strategy = kd.MirroredStrategy(cpus(n))
    with strategy.scope():
        with pytest.raises(_TestException):
            strategy.extended.call_for_each_replica(fn)
        # The strategy still works afterwards.
        out = strategy.run(lambda: _replica_id() * 10)
    assert _local(strategy, out) == [10 * i for i in range(n)]


def test_exception_object_is_the_one_raised(engine):
    strategy = kd.MirroredStrategy(cpus(2))
    error = _TestException("the original")

    def fn():
        raise error

    with pytest.raises(_TestException, match="the original") as info:
        strategy.run(fn)
    assert info.value is error


# ---------------------------------------------------------- 13. regroup error
@pytest.mark.parametrize("n", [2, 4])
def test_run_regroup_error(engine, n):
    strategy = kd.MirroredStrategy(cpus(n))
    lengths = _uneven(strategy, lambda i: i)  # replica i returns list(range(i))
    with strategy.scope():
        with pytest.raises(AssertionError):
            strategy.extended.call_for_each_replica(
                lambda x: [jnp.float32(j) for j in range(x.shape[0])], args=(lengths,)
            )


# ---------------------------------------------------------- 14. reduce to host
@pytest.mark.parametrize("n", [1, 2, 4])
def test_reduce_sum_of_replica_ids(engine, n):
    strategy = kd.MirroredStrategy(cpus(n))
    with strategy.scope():
        result = strategy.extended.call_for_each_replica(_replica_id)
        reduced = strategy.reduce(kd.ReduceOp.SUM, result, axis=None)
    assert int(reduced) == n * (n - 1) // 2
    if n == 2:
        assert int(reduced) == 1


@pytest.mark.parametrize("dtype", ["float32", "int32"])
@pytest.mark.parametrize("n", [2, 4])
def test_reduce_axis_of_uneven_replica_values(engine, n, dtype):
    strategy = kd.MirroredStrategy(cpus(n))
    zeros = _uneven(strategy, lambda i: i + 1, dtype)
    with strategy.scope():
        # Replica i returns [i] * (i + 1).
        result = strategy.extended.call_for_each_replica(lambda x: x + _replica_id(), args=(zeros,))
        assert _local(strategy, result)[1] == [1, 1]
        total = sum(i * (i + 1) for i in range(n))
        count = sum(i + 1 for i in range(n))
        reduced_sum = strategy.reduce(kd.ReduceOp.SUM, result, axis=0)
        reduced_mean = strategy.reduce(kd.ReduceOp.MEAN, result, axis=0)
    assert float(reduced_sum) == total
    np.testing.assert_allclose(float(reduced_mean), total / count, atol=1e-5)
    if n == 2:  # TF's numbers
        assert float(reduced_sum) == 2
        np.testing.assert_allclose(float(reduced_mean), 2 / 3, atol=1e-5)


@pytest.mark.parametrize("n", [2, 4])
def test_reduce_axis_of_even_replica_values(engine, n):
    strategy = kd.MirroredStrategy(cpus(n))
    # Replica i returns [i, i]: same shapes, so the compiled engine runs it.
    result = strategy.run(lambda: jnp.full((2,), _replica_id(), "float32"))
    total = 2 * sum(range(n))
    assert float(strategy.reduce("SUM", result, axis=0)) == total
    assert float(strategy.reduce("MEAN", result, axis=0)) == total / (2 * n)


# ---------------------------------------- 15. distribute_values_from_function
@pytest.mark.parametrize("n", [1, 2, 4])
def test_reduce_values_from_function(n):
    strategy = kd.MirroredStrategy(cpus(n))
    value = strategy.experimental_distribute_values_from_function(lambda _: np.float32(1.0))
    with strategy.scope():
        assert float(strategy.reduce(kd.ReduceOp.SUM, value=value, axis=None)) == 1.0 * n
    assert float(strategy.reduce(kd.ReduceOp.SUM, value=value, axis=None)) == 1.0 * n


def test_reduce_values_from_function_one_device():
    strategy = kd.OneDeviceStrategy("/cpu:0")
    value = strategy.experimental_distribute_values_from_function(lambda _: np.float32(1.0))
    assert float(strategy.reduce("SUM", value, axis=None)) == 1.0


@pytest.mark.parametrize("n", [1, 2, 4])
def test_reduce_with_axis(engine, n):
    strategy = kd.MirroredStrategy(cpus(n))
    x = strategy.run(lambda: jnp.array([1.0, 2.0]))
    assert float(strategy.reduce(kd.ReduceOp.MEAN, x, axis=0)) == 1.5
    assert float(strategy.reduce(kd.ReduceOp.SUM, x, axis=0)) == 3.0 * n


def test_reduce_with_axis_one_device(engine):
    strategy = kd.OneDeviceStrategy("/cpu:0")
    x = strategy.run(lambda: jnp.array([1.0, 2.0]))
    assert float(strategy.reduce("MEAN", x, axis=0)) == 1.5
    assert float(strategy.reduce("SUM", x, axis=0)) == 3.0


def test_reduce_with_an_axis_of_values_unlike_beside_it_says_so():
    strategy = kd.MirroredStrategy(cpus(2))
    unlike = kd.PerReplica((np.ones((2, 1), "float32"), np.ones((2, 3), "float32")))
    with pytest.raises(ValueError, match=r"shape except along that axis.*\(2, 1\), \(2, 3\)"):
        strategy.reduce("SUM", unlike, axis=0)
    # gather too (TF raises ValueError or InvalidArgumentError, not a TypeError).
    with pytest.raises(ValueError, match=r"`strategy.gather` with an axis.*\(2, 1\), \(2, 3\)"):
        strategy.gather(unlike, axis=0)
    np.testing.assert_array_equal(strategy.gather(unlike, axis=1), np.ones((2, 4)))
    # Along the axis where they differ, they reduce (each row: 1 + 3, as TF).
    np.testing.assert_array_equal(strategy.reduce("SUM", unlike, axis=-1), [4.0, 4.0])


@pytest.mark.parametrize("args", [None, 3.0, {"x": 1.0}])
def test_run_takes_args_as_a_list_or_tuple_as_tf(args):
    strategy = kd.MirroredStrategy(cpus(2))
    with pytest.raises(ValueError, match="positional args must be a list or tuple.*Received"):
        strategy.run(lambda *a: 1.0, args=args)
    assert _local(strategy, strategy.run(lambda x: x + 1.0, args=[1.0])) == [2.0, 2.0]


def test_compute_average_loss_and_scale_regularization_loss_need_a_replica_in_a_scope():
    strategy = kd.MirroredStrategy(cpus(4))
    with strategy.scope():
        for call in (
            lambda: kd.nn.compute_average_loss(np.ones(4, "float32")),
            lambda: kd.nn.scale_regularization_loss(np.ones((), "float32")),
        ):
            with pytest.raises(RuntimeError, match="in cross replica context.*strategy.run"):
                call()
        # A given global batch size needs no replica (TF's rule).
        assert float(kd.nn.compute_average_loss(np.ones(4, "float32"), global_batch_size=8)) == 0.5
    per_replica = strategy.run(lambda: kd.nn.compute_average_loss(jnp.ones(4)))
    assert float(strategy.reduce("SUM", per_replica, axis=None)) == 1.0
    assert float(kd.nn.compute_average_loss(np.ones(4, "float32"))) == 1.0  # no strategy


def test_reduce_non_distributed_value_with_sum_raises():
    strategy = kd.MirroredStrategy(cpus(2))
    with pytest.raises(ValueError, match="cannot be reduced with the given reduce op ReduceOp.SUM"):
        strategy.reduce("SUM", 5.0, axis=None)
    assert float(strategy.reduce("MEAN", 5.0, axis=None)) == 5.0


# ------------------------------------------------------------------ 17. gather
@pytest.mark.parametrize("n", [1, 2, 4])
def test_gather_1d_on_axis_0(engine, n):
    strategy = kd.MirroredStrategy(cpus(n))
    single_value = np.array([1, 2, 3], "int32")
    from_function = strategy.experimental_distribute_values_from_function(lambda _: single_value)
    from_run = strategy.run(lambda: jnp.asarray(single_value))
    for value in (from_function, from_run):
        gathered = strategy.gather(value, axis=0)
        assert gathered.shape == (3 * n,)
        np.testing.assert_array_equal(gathered, np.concatenate([single_value] * n, axis=0))


@pytest.mark.parametrize("n", [1, 2, 4])
def test_gather_2d_on_axis_1(engine, n):
    strategy = kd.MirroredStrategy(cpus(n))
    single_value = np.array([[1, 2, 3]], "int32")
    from_function = strategy.experimental_distribute_values_from_function(lambda _: single_value)
    from_run = strategy.run(lambda: jnp.asarray(single_value))
    for value in (from_function, from_run):
        gathered = strategy.gather(value, axis=1)
        assert gathered.shape == (1, 3 * n)
        np.testing.assert_array_equal(gathered, np.concatenate([single_value] * n, axis=1))


@pytest.mark.parametrize("n", [2, 4])
def test_gather_keeps_replica_order(engine, n):
    strategy = kd.MirroredStrategy(cpus(n))
    value = strategy.run(lambda: jnp.full((2,), _replica_id(), "int32"))
    np.testing.assert_array_equal(
        strategy.gather(value, axis=0), np.repeat(np.arange(n, dtype="int32"), 2)
    )


@pytest.mark.parametrize("n", [2, 4])
def test_gather_of_a_nest_gathers_each_element(engine, n):
    # As `reduce` of a nest and TF's `all_gather`: run's dict of per-replica values,
    # each gathered. (TF 2.21's `strategy.gather` of a nest gives replica 0's values.)
    strategy = kd.MirroredStrategy(cpus(n))

    def step():
        rid = _replica_id()
        return {"a": jnp.full((1, 2), rid), "b": (jnp.zeros((2,)) + rid,)}

    @kd.function
    def gathered_in_function():
        return strategy.gather(strategy.run(step), axis=0)

    expected_a = np.repeat(np.arange(n, dtype="float32"), 2).reshape(n, 2)
    for gathered in (strategy.gather(strategy.run(step), axis=0), gathered_in_function()):
        np.testing.assert_array_equal(gathered["a"], expected_a)
        np.testing.assert_array_equal(gathered["b"][0], expected_a.ravel())


@pytest.mark.parametrize("n", [1, 2, 4])
def test_gather_of_a_plain_value_gives_it_back_as_tf(engine, n):
    # TF 2.21 MirroredStrategy(2): gather(constant([[1., 2.]]), axis=0 or 1) is
    # [[1., 2.]], eagerly and in a tf.function: one component, not one per replica.
    strategy = kd.MirroredStrategy(cpus(n))
    value = np.array([[1.0, 2.0]], "float32")

    @kd.function
    def gathered_in_function():
        return strategy.gather(value, axis=1)

    for axis in (0, 1):
        np.testing.assert_array_equal(strategy.gather(value, axis=axis), value)
    np.testing.assert_array_equal(gathered_in_function(), value)


def test_gather_one_device(engine):
    strategy = kd.OneDeviceStrategy("/cpu:0")
    value = strategy.run(lambda: jnp.array([1, 2, 3]))
    np.testing.assert_array_equal(strategy.gather(value, axis=0), [1, 2, 3])


def test_reduce_of_a_nest_reduces_each_element_as_tf(engine):
    # TF 2.21: the tuple/dict `run` returns, reduced with axis=None, element by element
    # (a batch of 0..7 on 4 replicas: sums 28.0, max 16.0 summed over replicas).
    strategy = kd.MirroredStrategy(cpus(4))
    batch = next(iter(strategy.experimental_distribute_dataset([np.arange(8, dtype="float32")])))
    out = strategy.run(lambda x: (jnp.sum(x), jnp.max(x)), args=(batch,))
    total, top = strategy.reduce("SUM", out, axis=None)
    assert (float(total), float(top)) == (28.0, 16.0)
    means = strategy.reduce("MEAN", {"a": out[0], "b": out[1]}, axis=None)
    assert {k: float(v) for k, v in means.items()} == {"a": 7.0, "b": 4.0}

    @kd.function
    def step(x):
        return strategy.reduce("SUM", strategy.run(lambda x: (jnp.sum(x), jnp.max(x)), (x,)), None)

    assert [float(v) for v in step(batch)] == [28.0, 16.0]
    with pytest.raises(ValueError, match="reduce each element"):
        strategy.reduce("SUM", out, axis=0)
    # A list of numbers is still one (non-distributed) array, as before.
    np.testing.assert_array_equal(
        np.asarray(strategy.reduce("MEAN", [1.0, 2.0], axis=None)), [1, 2]
    )


@pytest.mark.parametrize("aggregation", ["sum", "mean", "only_first_replica"])
def test_reduce_of_a_distributed_variable_reduces_its_per_replica_values_as_tf(aggregation):
    # TF 2.21 on 2 replicas, components [1, 2]: SUM 3.0 and MEAN 1.5 for every aggregation;
    # a mirrored 2.0: SUM 4.0, MEAN 2.0.
    strategy = kd.MirroredStrategy(cpus(2))
    with strategy.scope():
        on_read = keras.Variable(0.0, synchronization="on_read", aggregation=aggregation)
        mirrored = keras.Variable(2.0)
    strategy.run(lambda: on_read.assign(jnp.float32(_replica_id() + 1)))
    assert _local(strategy, on_read) == [1.0, 2.0]
    assert float(strategy.reduce("SUM", on_read, axis=None)) == 3.0
    assert float(strategy.reduce("MEAN", on_read, axis=None)) == 1.5
    assert float(strategy.reduce("SUM", mirrored, axis=None)) == 4.0
    assert float(strategy.reduce("MEAN", mirrored, axis=None)) == 2.0


def test_a_variable_without_synchronization_is_refused_in_a_scope_as_tf():
    strategy = kd.MirroredStrategy(cpus(2))
    with strategy.scope():
        with pytest.raises(ValueError, match="`NONE` variable synchronization mode is not"):
            keras.Variable(1.0, synchronization="none")
    assert float(keras.Variable(1.0, synchronization="none").numpy()) == 1.0  # no strategy
    with kd.OneDeviceStrategy("/cpu:0").scope():  # TF's OneDeviceStrategy allows it too
        assert float(keras.Variable(2.0, synchronization="none").numpy()) == 2.0
