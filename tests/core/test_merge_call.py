"""merge_call and the replica context (from TF's strategy_test_lib.py and friends)."""

import re

import jax
import jax.numpy as jnp
import keras
import numpy as np
import pytest
from conftest import cpus

import keras_dist as kd

_CROSS_REPLICA_ONLY = re.escape(
    "Method requires being in cross-replica context, use get_replica_context().merge_call()"
)


def _local(strategy, value):
    return [np.asarray(x).tolist() for x in strategy.experimental_local_results(value)]


def _each(strategy, value):
    """What every replica holds. As in TF, a value that is the same object on
    every replica (a merge_call result, in the eager engine) is not wrapped."""
    local = _local(strategy, value)
    n = strategy.num_replicas_in_sync
    return local * n if len(local) == 1 else local


def _replica_id():
    return kd.get_replica_context().replica_id_in_sync_group


def _mirrored(n):
    return kd.MirroredStrategy(cpus(n))


# ------------------------------------------- 19. cross-replica-only methods
CROSS_REPLICA_ONLY_CALLS = {
    "reduce": lambda s, x: s.reduce("SUM", x, axis=None),
    "gather": lambda s, x: s.gather(x, axis=0),
    "reduce_to": lambda s, x: s.extended.reduce_to("SUM", x, None),
    "batch_reduce_to": lambda s, x: s.extended.batch_reduce_to("SUM", [(x, None)]),
    "broadcast_to": lambda s, x: s.extended.broadcast_to(x, None),
    "update": lambda s, x: s.extended.update(None, lambda v: v),
}


@pytest.mark.parametrize("method", sorted(CROSS_REPLICA_ONLY_CALLS))
@pytest.mark.parametrize("n", [1, 2])
def test_cross_replica_method_in_replica_context_raises(engine, n, method):
    strategy = _mirrored(n)
    call = CROSS_REPLICA_ONLY_CALLS[method]
    with pytest.raises(RuntimeError, match=_CROSS_REPLICA_ONLY):
        strategy.run(lambda: call(strategy, jnp.ones((1,))))


@pytest.mark.parametrize("method", sorted(CROSS_REPLICA_ONLY_CALLS))
def test_cross_replica_method_in_one_device_replica_raises(engine, method):
    strategy = kd.OneDeviceStrategy("/cpu:0")
    call = CROSS_REPLICA_ONLY_CALLS[method]
    with pytest.raises(RuntimeError, match=_CROSS_REPLICA_ONLY):
        strategy.run(lambda: call(strategy, jnp.ones((1,))))


@pytest.mark.parametrize("n", [1, 2, 4])
def test_cross_replica_methods_work_from_merge_call(engine, n):
    strategy = _mirrored(n)

    def merge_fn(s, x):
        total = s.reduce("SUM", x, axis=None)
        (reduced,) = s.extended.batch_reduce_to("MEAN", [(x, x)])
        return total, reduced

    def gather_fn(s, x):
        return s.gather(x, axis=0)

    def fn():
        x = jnp.float32(_replica_id())
        ctx = kd.get_replica_context()
        total, mean = ctx.merge_call(merge_fn, args=(x,))
        return total, mean, ctx.merge_call(gather_fn, args=(x[None],))

    total, mean, gathered = strategy.run(fn)
    assert _each(strategy, total) == [n * (n - 1) / 2] * n
    assert _each(strategy, mean) == [(n - 1) / 2] * n
    assert _each(strategy, gathered) == [list(map(float, range(n)))] * n


# ------------------------------------------------------------- merge_call
@pytest.mark.parametrize("n", [1, 2, 4])
def test_merge_call_sees_per_replica_args_and_returns_each_replica_its_part(engine, n):
    strategy = _mirrored(n)
    seen = []

    def merge_fn(s, x, scale):
        seen.append(
            (
                s,
                kd.get_replica_context(),
                kd.get_cross_replica_context(),
                kd.in_cross_replica_context(),
            )
        )
        if n > 1:
            assert isinstance(x, kd.PerReplica)
        # A per-replica value goes back to its replicas; anything else to every replica.
        return x, jnp.stack(s.experimental_local_results(x)) * scale

    def fn():
        x = jnp.float32(10.0 * _replica_id())
        return kd.get_replica_context().merge_call(merge_fn, args=(x,), kwargs={"scale": 2.0})

    own, everyone = strategy.run(fn)
    assert _local(strategy, own) == [10.0 * i for i in range(n)]
    assert _each(strategy, everyone) == [[20.0 * i for i in range(n)]] * n
    assert seen == [(strategy, None, strategy, True)]  # merge_fn runs once


@pytest.mark.parametrize("n", [2, 4])
def test_call_for_each_replica_inside_merge_call(engine, n):
    strategy = _mirrored(n)

    def merge_fn(s, x):
        inner = s.extended.call_for_each_replica(lambda y: y * 10 + _replica_id(), args=(x,))
        return s.extended.reduce_to("SUM", inner, inner)

    def fn():
        return kd.get_replica_context().merge_call(merge_fn, args=(jnp.float32(_replica_id()),))

    out = strategy.run(fn)
    assert _local(strategy, out) == [11.0 * n * (n - 1) / 2] * n


# ---------------------------------------------- 20. _replica_ctx_all_reduce
STRATEGIES = {
    "default": lambda: kd.get_strategy(),
    "one_device": lambda: kd.OneDeviceStrategy("/cpu:0"),
    "mirrored1": lambda: _mirrored(1),
    "mirrored2": lambda: _mirrored(2),
    "mirrored4": lambda: _mirrored(4),
}


@pytest.mark.parametrize("name", sorted(STRATEGIES))
def test_replica_ctx_all_reduce(engine, name):
    strategy = STRATEGIES[name]()
    n = strategy.num_replicas_in_sync

    def replica_fn():
        reduced = strategy.extended._replica_ctx_all_reduce(kd.ReduceOp.SUM, jnp.float32(1.0))
        same = kd.get_replica_context().all_reduce("SUM", 1.0)
        return reduced, same

    reduced, same = strategy.run(replica_fn)
    assert _local(strategy, reduced) == [1.0 * n] * n
    assert _local(strategy, same) == [1.0 * n] * n


def test_replica_ctx_all_reduce_outside_replica_raises():
    strategy = _mirrored(2)
    with strategy.scope():
        with pytest.raises(RuntimeError, match="must be called in a replica context"):
            strategy.extended._replica_ctx_all_reduce("SUM", 1.0)


@pytest.mark.parametrize("n", [2, 4])
def test_all_reduce_nested_input(engine, n):
    strategy = _mirrored(n)

    def replica_fn():
        value = (jnp.float32(1.0), jnp.array([[1.0]]), 2.0, {"a": jnp.array([2, 3])})
        return kd.get_replica_context().all_reduce("SUM", value)

    one, matrix, two, tree = strategy.run(replica_fn)
    assert _local(strategy, one) == [1.0 * n] * n
    assert _local(strategy, matrix) == [[[1.0 * n]]] * n
    assert _local(strategy, two) == [2.0 * n] * n
    assert _local(strategy, tree["a"]) == [[2 * n, 3 * n]] * n


# ------------------------------------------------ 21. all_reduce of inputs
def _all_sum(value):
    return kd.get_replica_context().all_reduce(kd.ReduceOp.SUM, value)


def _all_mean(value):
    return kd.get_replica_context().all_reduce(kd.ReduceOp.MEAN, value)


def _inputs(strategy, elements):
    """Replica i gets ``elements[i]``, as from_tensor_slices gives one element per replica."""
    return strategy.experimental_distribute_values_from_function(
        lambda ctx: np.asarray(elements[ctx.replica_id_in_sync_group], "float32")
    )


def _collective_comms(strategy, comm_fn, scalars, vectors):
    xs = _inputs(strategy, scalars)
    ys = _inputs(strategy, vectors)
    out = strategy.run(lambda x, y: (comm_fn(x), comm_fn(y)), args=(xs, ys))
    return _local(strategy, out[0]), _local(strategy, out[1])


def test_all_reduce_sum(engine):
    strategy = _mirrored(2)
    x, y = _collective_comms(strategy, _all_sum, [1.0, 3.0], [[39.0, 2.0], [3.0, 41.0]])
    assert x == [4.0, 4.0]
    assert y == [[42.0, 43.0], [42.0, 43.0]]


def test_all_reduce_mean(engine):
    strategy = _mirrored(2)
    x, y = _collective_comms(strategy, _all_mean, [1.0, 3.0], [[39.0, 2.0], [3.0, 41.0]])
    assert x == [2.0, 2.0]
    assert y == [[21.0, 21.5], [21.0, 21.5]]


@pytest.mark.parametrize("comm_fn", [_all_sum, _all_mean], ids=["sum", "mean"])
def test_all_reduce_four_replicas(engine, comm_fn):
    strategy = _mirrored(4)
    scalars = [1.0, 3.0, 5.0, 7.0]
    vectors = [[39.0, 2.0], [3.0, 41.0], [1.0, 1.0], [5.0, 4.0]]
    x, y = _collective_comms(strategy, comm_fn, scalars, vectors)
    divisor = 4 if comm_fn is _all_mean else 1
    assert x == [sum(scalars) / divisor] * 4
    assert y == [(np.sum(vectors, axis=0) / divisor).tolist()] * 4


@pytest.mark.parametrize(
    "make", [lambda: kd.OneDeviceStrategy("/cpu:0"), lambda: _mirrored(1)], ids=["one", "m1"]
)
def test_all_reduce_on_one_device_is_identity(engine, make):
    strategy = make()
    assert _collective_comms(strategy, _all_sum, [4.0], [[42.0, 43.0]]) == ([4.0], [[42.0, 43.0]])
    assert _collective_comms(strategy, _all_mean, [2.0], [[21.0, 22.0]]) == ([2.0], [[21.0, 22.0]])


# Gradients of an all-reduce: compiled engine only (jax.grad cannot cross the
# eager engine's replica threads).
def _gradient_of_all_reduce(strategy, comm_fn, cs):
    assert not kd.config.functions_run_eagerly()

    def step(c):
        return jax.grad(lambda x: comm_fn(x) * c)(jnp.float32(42.0))

    return _local(strategy, strategy.run(step, args=(_inputs(strategy, cs),)))


def _gradient_of_all_reduce_variable(strategy, comm_fn, cs):
    assert not kd.config.functions_run_eagerly()
    with strategy.scope():
        x = keras.Variable(42.0)

    def step(c):
        _, grads = kd.value_and_grad(lambda: comm_fn(x.value) * c, [x])()
        return grads[0]

    return _local(strategy, strategy.run(step, args=(_inputs(strategy, cs),)))


@pytest.mark.parametrize("grad_fn", [_gradient_of_all_reduce, _gradient_of_all_reduce_variable])
def test_all_reduce_gradients(grad_fn):
    strategy = _mirrored(2)
    assert grad_fn(strategy, _all_sum, [1.0, 3.0]) == [4.0, 4.0]
    assert grad_fn(strategy, _all_mean, [1.0, 3.0]) == [2.0, 2.0]


@pytest.mark.parametrize("grad_fn", [_gradient_of_all_reduce, _gradient_of_all_reduce_variable])
def test_all_reduce_gradients_four_replicas(grad_fn):
    strategy = _mirrored(4)
    cs = [1.0, 3.0, 5.0, 7.0]
    assert grad_fn(strategy, _all_sum, cs) == [16.0] * 4
    assert grad_fn(strategy, _all_mean, cs) == [4.0] * 4


@pytest.mark.parametrize(
    "make", [lambda: kd.OneDeviceStrategy("/cpu:0"), lambda: _mirrored(1)], ids=["one", "m1"]
)
@pytest.mark.parametrize("grad_fn", [_gradient_of_all_reduce, _gradient_of_all_reduce_variable])
def test_all_reduce_gradients_one_device(make, grad_fn):
    strategy = make()
    assert grad_fn(strategy, _all_sum, [4.0]) == [4.0]
    assert grad_fn(strategy, _all_mean, [5.0]) == [5.0]


# ------------------------------------------- 22. all_reduce of a variable
@pytest.mark.parametrize(
    "synchronization, aggregation",
    [("on_write", "mean"), ("on_write", "sum"), ("on_read", "mean"), ("on_read", "sum")],
)
@pytest.mark.parametrize("n", [2, 4])
def test_all_reduce_of_variable(engine, n, synchronization, aggregation):
    strategy = _mirrored(n)
    with strategy.scope():
        v = keras.Variable(2.0, synchronization=synchronization, aggregation=aggregation)

    def all_reduce():
        ctx = kd.get_replica_context()
        return ctx.all_reduce("SUM", v) + jnp.float32(ctx.replica_id_in_sync_group)

    out = strategy.run(all_reduce)
    assert _local(strategy, out) == [2.0 * n + i for i in range(n)]
    if n == 2:
        assert _local(strategy, out) == [4.0, 5.0]
