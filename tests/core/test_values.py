"""Distributed values (from TF's values_test.py and distribute_lib_test.py).

On JAX, ``PerReplica`` and ``Mirrored`` are pytrees: what TF tests of their
``TypeSpec`` (components, round trips, ``nest.map_structure`` with composites,
no retracing of a ``tf.function``) is tested here with ``jax.tree_util`` and
``jax.jit``.
"""

import copy

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import cpus

import keras_dist as kd
from keras_dist._values import DistributedDelegate


def _gather(strategy, value):
    """TF's ``ds_test_util.gather``: the replicas' components stacked on a new axis 0."""
    return jax.tree_util.tree_map(
        lambda v: np.stack([np.asarray(c) for c in strategy.experimental_local_results(v)]),
        value,
        is_leaf=lambda v: isinstance(v, kd.DistributedValues),
    )


N = [1, 2, 4]


# --------------------------------------- 25. distribute_values_from_function
@pytest.mark.parametrize("n", N)
def test_values_from_function_constant(n):
    strategy = kd.MirroredStrategy(cpus(n))
    single_value = jnp.asarray(1)
    values = strategy.experimental_distribute_values_from_function(lambda ctx: single_value)
    np.testing.assert_array_equal(_gather(strategy, values), [1] * n)


@pytest.mark.parametrize("n", N)
def test_values_from_function_numpy_array(n):
    strategy = kd.MirroredStrategy(cpus(n))
    array_value = np.array([1, 2, 3])
    values = strategy.experimental_distribute_values_from_function(lambda ctx: array_value)
    np.testing.assert_array_equal(_gather(strategy, values), [[1, 2, 3]] * n)


@pytest.mark.parametrize("n", N)
def test_values_from_function_tuple(n):
    strategy = kd.MirroredStrategy(cpus(n))
    values = strategy.experimental_distribute_values_from_function(lambda ctx: (1, 2, 3))
    gathered = _gather(strategy, values)
    assert isinstance(gathered, tuple)
    for got, want in zip(gathered, ([1] * n, [2] * n, [3] * n), strict=True):
        np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("n", N)
def test_values_from_function_nested_per_replica(n):
    strategy = kd.MirroredStrategy(cpus(n))
    values = strategy.experimental_distribute_values_from_function(
        lambda ctx: tuple(v * ctx.replica_id_in_sync_group for v in (1, 2, 3))
    )
    gathered = _gather(strategy, values)
    for v, got in zip((1, 2, 3), gathered, strict=True):
        np.testing.assert_array_equal(got, [v * i for i in range(n)])
    if n == 2:  # TF's numbers
        assert [g.tolist() for g in gathered] == [[0, 1], [0, 2], [0, 3]]


@pytest.mark.parametrize("n", N)
def test_values_from_function_by_replica_id_then_run(engine, n):
    strategy = kd.MirroredStrategy(cpus(n))
    array_value = np.arange(n, dtype="float32")
    values = strategy.experimental_distribute_values_from_function(
        lambda ctx: array_value[ctx.replica_id_in_sync_group]
    )
    np.testing.assert_array_equal(_gather(strategy, values), range(n))
    squared = strategy.run(jnp.square, args=(values,))
    np.testing.assert_array_equal(_gather(strategy, squared), [i * i for i in range(n)])


@pytest.mark.parametrize("n", N)
def test_values_from_function_places_each_component_on_its_replica(n):
    strategy = kd.MirroredStrategy(cpus(n))
    values = strategy.experimental_distribute_values_from_function(
        lambda ctx: np.float32(ctx.replica_id_in_sync_group)
    )
    assert isinstance(values, kd.PerReplica)
    components = strategy.experimental_local_results(values)
    assert [c.devices() for c in components] == [{d} for d in jax.devices("cpu")[:n]]


def test_values_from_function_value_context():
    strategy = kd.MirroredStrategy(cpus(4))
    contexts = []
    strategy.experimental_distribute_values_from_function(lambda ctx: contexts.append(ctx) or 0)
    assert [(c.replica_id_in_sync_group, c.num_replicas_in_sync) for c in contexts] == [
        (i, 4) for i in range(4)
    ]


def test_values_from_function_one_device():
    strategy = kd.OneDeviceStrategy("/cpu:0")
    values = strategy.experimental_distribute_values_from_function(lambda ctx: (1, 2, 3))
    assert [g.tolist() for g in _gather(strategy, values)] == [[1], [2], [3]]


# ---------------------------------------------------- 26. DistributedDelegate
def test_delegate_get_attr():
    v = DistributedDelegate((np.array([7, 7]), np.array([8])))
    assert v.shape == (2,)  # the first component's attribute
    assert v.sum() == 14
    with pytest.raises(AttributeError):
        _ = v.y


def test_delegate_operator_override():
    v = DistributedDelegate((7, 8))
    # v should act like int(7).
    assert v + 1 == 8
    assert 3 + v == 10
    assert v + v == 14
    assert v - 2 == 5
    assert 13 - v == 6
    assert v - v == 0
    assert v * 2 == 14
    assert 3 * v == 21
    assert v * v == 49
    assert v / 2 == 3.5
    assert 10.5 / v == 1.5
    assert v // 2 == 3
    assert 15 // v == 2
    assert v % 2 == 1
    assert 16 % v == 2
    assert v < 12
    assert v <= 12
    assert not v > 12
    assert not v >= 12
    assert not 12 < v
    assert not 12 <= v
    assert 12 > v
    assert 12 >= v
    assert v & 3 == 3
    assert 11 & v == 3
    assert v | 8 == 15
    assert 16 | v == 23
    assert v ^ 3 == 4
    assert 11 ^ v == 12
    assert pow(v, 3) == 343
    assert pow(v, 3, 10) == 3
    assert pow(2, v) == 128
    assert -v == -7
    assert ~v == ~7
    assert abs(v) == 7
    assert divmod(v, 2) == (3, 1)
    assert v << 1 == 14
    assert v >> 1 == 3
    with pytest.raises(TypeError):
        _ = v[2]


def test_delegate_conversions():
    v = DistributedDelegate((7, 8))
    assert (int(v), float(v), bool(v)) == (7, 7.0, True)
    assert [10, 11, 12, 13, 14, 15, 16, 17][v] == 17  # __index__
    assert np.asarray(v).tolist() == 7
    assert jnp.asarray(v).tolist() == 7  # through __jax_array__


def test_delegate_copy():
    v = DistributedDelegate((np.array([7]), np.array([8])))
    shallow = copy.copy(v)
    assert shallow is not v
    assert shallow.values[0] is v.values[0]
    assert shallow.tolist() == v.tolist() == [7]
    deep = copy.deepcopy(v)
    assert deep.values[0] is not v.values[0]
    assert deep.tolist() == v.tolist() == [7]
    assert [c.tolist() for c in deep.values] == [[7], [8]]


# --------------------------------------------------- 27. PerReplica, Mirrored
def test_per_replica_spec():
    per_replica = kd.PerReplica((jnp.float32(1.0),))
    spec = jax.eval_shape(lambda x: x, per_replica)
    assert isinstance(spec, kd.PerReplica)
    assert spec.values == (jax.ShapeDtypeStruct((), jnp.float32),)


def test_per_replica_components_round_trip():
    per_replica = kd.PerReplica((jnp.float32(1.0),))
    components, treedef = jax.tree_util.tree_flatten(per_replica)
    assert len(components) == 1
    reconstructed = jax.tree_util.tree_unflatten(treedef, components)
    assert isinstance(reconstructed, kd.PerReplica)
    np.testing.assert_array_equal(reconstructed.values, per_replica.values)


def test_per_replica_nest():
    per_replica = kd.PerReplica((jnp.float32(1.0), jnp.array([5.0, 6.0])))
    result = jax.tree_util.tree_map(lambda t: t + 10, per_replica)
    assert isinstance(result, kd.PerReplica)
    assert len(result.values) == 2
    assert float(result.values[0]) == 11.0
    assert result.values[1].tolist() == [15.0, 16.0]


def test_per_replica_does_not_trigger_retracing():
    traces = []

    @jax.jit
    def f(x):
        traces.append(None)  # only happens on trace
        return x

    per_replica = kd.PerReplica((jnp.float32(1.0),))
    f(per_replica)
    assert traces
    del traces[:]
    for _ in range(5):
        components, treedef = jax.tree_util.tree_flatten(per_replica)
        per_replica = jax.tree_util.tree_unflatten(treedef, [v * 2 for v in components])
        output = f(per_replica)
        assert isinstance(output, kd.PerReplica)
        np.testing.assert_array_equal(output.values, per_replica.values)
        assert not traces  # not retraced
    assert float(per_replica.values[0]) == 32.0


def test_function_can_return_per_replica():
    f = jax.jit(lambda x: x)
    x = kd.PerReplica((jnp.float32(1.0),))
    y = f(x)
    assert y is not x
    assert isinstance(y, kd.PerReplica)
    jax.tree_util.tree_map(np.testing.assert_array_equal, x, y)
    assert jax.tree_util.tree_structure(x) == jax.tree_util.tree_structure(y)


def test_cond_with_per_replica_values():
    per_replica_1 = kd.PerReplica((jnp.float32(1.0),))
    per_replica_2 = kd.PerReplica((jnp.float32(2.0),))
    for condition, expected in ((True, 1.0), (False, 2.0)):
        result = jax.lax.cond(condition, lambda: per_replica_1, lambda: per_replica_2)
        assert isinstance(result, kd.PerReplica)
        assert len(result.values) == 1
        assert float(result.values[0]) == expected


def test_per_replica_with_values_not_convertible_to_tensor_raises():
    with pytest.raises(TypeError, match="Could not build a TypeSpec for"):
        kd.PerReplica(({"a"},))
    with pytest.raises(TypeError, match="Could not build a TypeSpec for"):
        kd.PerReplica(({"b", "c"},))
    with pytest.raises(TypeError, match="Could not build a TypeSpec for"):
        kd.Mirrored((object(), object()))


def test_per_replica_from_run_is_a_pytree(engine):
    strategy = kd.MirroredStrategy(cpus(2))
    out = strategy.run(lambda: jnp.float32(kd.get_replica_context().replica_id_in_sync_group))
    assert isinstance(out, kd.PerReplica)
    assert [float(c) for c in jax.tree_util.tree_leaves(out)] == [0.0, 1.0]
    plus = jax.tree_util.tree_map(lambda t: t + 10, out)
    assert [float(c) for c in strategy.experimental_local_results(plus)] == [10.0, 11.0]


def _make_mirrored(value, n=2):
    devices = jax.devices("cpu")[:n]
    return kd.Mirrored(tuple(jax.device_put(jnp.float32(value), d) for d in devices))


def test_mirrored_add():
    mirrored = _make_mirrored(3.0)
    assert float(mirrored + mirrored) == 6.0
    assert float(mirrored + 1) == 4.0
    assert float(mirrored + 1) == float(jnp.add(mirrored, 1))
    assert type(mirrored + 1) is type(jnp.add(mirrored, 1))


def test_mirrored_python_values():
    m = kd.Mirrored((3.0, 3.0))
    assert m + m == 6.0
    assert m + 1 == 4.0


def test_mirrored_from_broadcast_and_reduce_acts_as_its_value():
    strategy = kd.MirroredStrategy(cpus(2))
    broadcast = strategy.extended.broadcast_to(3.0, None)
    assert isinstance(broadcast, kd.Mirrored)
    assert [float(c) for c in strategy.experimental_local_results(broadcast)] == [3.0, 3.0]
    assert float(broadcast + broadcast) == 6.0
    assert float(broadcast + 1) == 4.0
    reduced = strategy.extended.reduce_to("SUM", kd.PerReplica((1.0, 2.0)), None)
    assert isinstance(reduced, kd.Mirrored)
    assert float(reduced * 2) == 6.0


def test_mirrored_is_a_pytree():
    mirrored = _make_mirrored(3.0)
    doubled = jax.tree_util.tree_map(lambda t: t * 2, mirrored)
    assert isinstance(doubled, kd.Mirrored)
    assert [float(c) for c in doubled.values] == [6.0, 6.0]
