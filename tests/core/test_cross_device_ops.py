"""CrossDeviceOps, after TF's cross_device_ops_test.py.

Every reduction path (``NcclAllReduce``, ``HierarchicalCopyAllReduce`` with 8
and 1 packs, ``ReductionToOneDevice`` by default, to "/cpu:0", and with a custom
``accumulation_fn``, and the ``CrossDeviceOps`` base class) is given to
``MirroredStrategy(devices, cross_device_ops=...)`` and checked with TF's numbers:
replica ``d`` holds ``float(d)``, so MEAN is ``(n-1)/2``, SUM is ``MEAN * n``, and
inputs ``d+1`` give ``MEAN+1``. Results
are ``Mirrored`` on the destinations. The same paths are then used inside
``strategy.run`` through ``ReplicaContext.all_reduce`` in both engines.

Spec 24 (IndexedSlices) does not apply on JAX: there are no IndexedSlices.
"""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import keras_dist as kd
from keras_dist._devices import resolve_device

try:
    from conftest import cpus
except ImportError:  # pragma: no cover - conftest is always importable under pytest

    def cpus(n):
        assert len(jax.devices("cpu")) >= n
        return [f"/cpu:{i}" for i in range(n)]


def _add_n(values):
    # A different accumulation than the default (TF used math_ops.accumulate_n).
    return jnp.sum(jnp.stack(values), axis=0)


OPS = {
    "NcclAllReduce": lambda: kd.NcclAllReduce(),
    "HierarchicalCopyAllReduce8": lambda: kd.HierarchicalCopyAllReduce(8),
    "HierarchicalCopyAllReduce1": lambda: kd.HierarchicalCopyAllReduce(1),
    "DefaultReductionToOneDevice": lambda: kd.ReductionToOneDevice(),
    "ReductionToCPUDevice": lambda: kd.ReductionToOneDevice(reduce_to_device="/cpu:0"),
    "AccumulateNReductionToOneDevice": lambda: kd.ReductionToOneDevice(accumulation_fn=_add_n),
    # The base class itself (or a user's subclass that overrides nothing): an all-reduce.
    "CrossDeviceOpsBase": lambda: kd.CrossDeviceOps(),
}

# A device no replica of the strategy uses (the strategies below use /cpu:0..3).
OTHER_DEVICE = "/cpu:7"


@pytest.fixture(params=list(OPS))
def ops(request):
    return OPS[request.param]()


def _per_replica(values, devices):
    return kd.PerReplica(
        tuple(
            jax.device_put(jnp.float32(v), resolve_device(d))
            for v, d in zip(values, devices, strict=True)
        )
    )


def _fake_mirrored(value, devices):
    return kd.Mirrored(
        tuple(jax.device_put(jnp.float32(value), resolve_device(d)) for d in devices)
    )


def _device_of(component):
    (device,) = component.devices()
    return device


def _assert_mirrored(result, expected, devices):
    """``result`` is a Mirrored holding ``expected`` once on each of ``devices``."""
    assert isinstance(result, kd.Mirrored), result
    components = result.values
    assert [_device_of(c) for c in components] == [resolve_device(d) for d in devices]
    for component in components:
        np.testing.assert_allclose(np.asarray(component), expected, rtol=1e-6)


def _cases(devices):
    """TF's inputs, expected means and destinations for ``devices``."""
    n = len(devices)
    per_replica = _per_replica([float(d) for d in range(n)], devices)
    per_replica_2 = _per_replica([d + 1.0 for d in range(n)], devices)
    mean = (n - 1.0) / 2.0
    mean_2 = mean + 1.0
    destinations = {
        "mirrored": (_fake_mirrored(1.0, devices), devices),
        "different": (_fake_mirrored(1.0, [OTHER_DEVICE]), [OTHER_DEVICE]),
        "string": ("/cpu:0", ["/cpu:0"]),
        "other_string": (OTHER_DEVICE, [OTHER_DEVICE]),
    }
    return per_replica, per_replica_2, mean, mean_2, destinations


@pytest.mark.parametrize("n", [1, 2, 4])
def test_strategy_uses_the_given_ops(ops, n):
    strategy = kd.MirroredStrategy(cpus(n), cross_device_ops=ops)
    assert strategy.extended._cross_device_ops is ops
    assert strategy.num_replicas_in_sync == n


def test_cross_device_ops_must_be_a_cross_device_ops():
    with pytest.raises(TypeError, match="`cross_device_ops` must be a keras_dist.CrossDeviceOps"):
        kd.MirroredStrategy(cpus(2), cross_device_ops="nccl")


@pytest.mark.parametrize("n", [1, 2, 4])
def test_reduce(ops, n):
    devices = cpus(n)
    strategy = kd.MirroredStrategy(devices, cross_device_ops=ops)
    per_replica, per_replica_2, mean, mean_2, destinations = _cases(devices)
    for destination, placed_on in destinations.values():
        # Through the strategy, as every library path reaches the ops.
        with strategy.scope():
            _assert_mirrored(
                strategy.extended.reduce_to("MEAN", per_replica, destination), mean, placed_on
            )
            _assert_mirrored(
                strategy.extended.reduce_to("MEAN", per_replica_2, destination), mean_2, placed_on
            )
            _assert_mirrored(
                strategy.extended.reduce_to("SUM", per_replica, destination), mean * n, placed_on
            )
            _assert_mirrored(
                strategy.extended.reduce_to(kd.ReduceOp.SUM, per_replica_2, destination),
                mean_2 * n,
                placed_on,
            )
            # And through the CrossDeviceOps object itself, as TF's test does.
            _assert_mirrored(
                ops.reduce(kd.ReduceOp.MEAN, per_replica, destinations=destination),
                mean,
                placed_on,
            )
            _assert_mirrored(
                ops.reduce(kd.ReduceOp.SUM, per_replica_2, destinations=destination),
                mean_2 * n,
                placed_on,
            )


@pytest.mark.parametrize("n", [2, 4])
def test_batch_reduce_every_pair_of_destinations(ops, n):
    devices = cpus(n)
    strategy = kd.MirroredStrategy(devices, cross_device_ops=ops)
    per_replica, per_replica_2, mean, mean_2, destinations = _cases(devices)
    with strategy.scope():
        for (d1, on1), (d2, on2) in itertools.product(destinations.values(), repeat=2):
            pairs = [(per_replica, d1), (per_replica_2, d2)]
            mean_results = ops.batch_reduce(kd.ReduceOp.MEAN, pairs)
            assert isinstance(mean_results, list) and len(mean_results) == 2
            _assert_mirrored(mean_results[0], mean, on1)
            _assert_mirrored(mean_results[1], mean_2, on2)
            sum_results = strategy.extended.batch_reduce_to("SUM", pairs)
            _assert_mirrored(sum_results[0], mean * n, on1)
            _assert_mirrored(sum_results[1], mean_2 * n, on2)


def test_batch_reduce_one_replica(ops):
    devices = cpus(1)
    strategy = kd.MirroredStrategy(devices, cross_device_ops=ops)
    per_replica, per_replica_2, _, _, _ = _cases(devices)
    with strategy.scope():
        results = ops.batch_reduce("SUM", [(per_replica, "/cpu:0"), (per_replica_2, "/cpu:0")])
    _assert_mirrored(results[0], 0.0, ["/cpu:0"])
    _assert_mirrored(results[1], 1.0, ["/cpu:0"])


@pytest.mark.parametrize("n", [1, 2, 4])
def test_broadcast(ops, n):
    devices = cpus(n)
    strategy = kd.MirroredStrategy(devices, cross_device_ops=ops)
    *_, destinations = _cases(devices)
    with strategy.scope():
        for destination, placed_on in destinations.values():
            _assert_mirrored(ops.broadcast(jnp.float32(1.0), destination), 1.0, placed_on)
            _assert_mirrored(
                strategy.extended.broadcast_to(jnp.float32(1.0), destination), 1.0, placed_on
            )


@pytest.mark.parametrize("n", [2, 4])
def test_reduce_of_run_results(ops, n):
    # The PerReplica `run` returns (stacked on the mesh in the compiled engine).
    strategy = kd.MirroredStrategy(cpus(n), cross_device_ops=ops)
    per_replica = strategy.run(lambda: kd.get_replica_context().replica_id_in_sync_group * 1.0)
    mean = (n - 1.0) / 2.0
    assert float(strategy.reduce("MEAN", per_replica, axis=None)) == mean
    assert float(strategy.reduce("SUM", per_replica, axis=None)) == mean * n
    with strategy.scope():
        _assert_mirrored(
            strategy.extended.reduce_to("SUM", per_replica, per_replica), mean * n, cpus(n)
        )


@pytest.mark.parametrize("n", [1, 2, 4])
def test_all_reduce_in_replica(ops, n, engine):
    strategy = kd.MirroredStrategy(cpus(n), cross_device_ops=ops)

    def step():
        ctx = kd.get_replica_context()
        d = ctx.replica_id_in_sync_group * 1.0
        return (
            ctx.all_reduce("MEAN", d),
            ctx.all_reduce(kd.ReduceOp.MEAN, d + 1.0),
            ctx.all_reduce("SUM", d),
            ctx.all_reduce("SUM", d + 1.0),
        )

    mean = (n - 1.0) / 2.0
    results = strategy.experimental_local_results(strategy.run(step))
    assert len(results) == n
    for replica in results:
        np.testing.assert_allclose(
            [float(x) for x in replica], [mean, mean + 1.0, mean * n, (mean + 1.0) * n]
        )


def test_a_mean_of_integers_is_a_float_on_one_host_as_tf(ops, engine):
    # TF 2.21's MirroredStrategy, int32 1 and 2 on 2 replicas: 1.5 from all_reduce,
    # batch_reduce_to and reduce alike (floor division would give 1).
    strategy = kd.MirroredStrategy(cpus(2), cross_device_ops=ops)
    ints = strategy.experimental_distribute_values_from_function(
        lambda context: np.int32(context.replica_id_in_sync_group + 1)
    )
    in_replica = strategy.run(lambda x: kd.get_replica_context().all_reduce("MEAN", x), (ints,))
    with strategy.scope():
        (batch,) = strategy.extended.batch_reduce_to("MEAN", [(ints, None)])
    for value in (*strategy.experimental_local_results(in_replica), batch):
        assert np.asarray(value).dtype == np.float32 and float(np.asarray(value)) == 1.5
    assert float(strategy.reduce("MEAN", ints, axis=None)) == 1.5


@pytest.mark.parametrize("n", [2, 4])
def test_all_reduce_nest_in_replica(ops, n, engine):
    # Several tensors of several dtypes and shapes in one all_reduce: packed
    # into one buffer per dtype (a 5-vector does not split evenly in packs).
    strategy = kd.MirroredStrategy(cpus(n), cross_device_ops=ops)

    def step():
        ctx = kd.get_replica_context()
        replica_id = ctx.replica_id_in_sync_group
        d = replica_id * 1.0
        nest = {
            "scalar": jnp.float32(d),
            "vector": jnp.arange(5, dtype=jnp.float32) + d,
            "matrix": jnp.full((2, 3), d + 1.0, jnp.float32),
            "int": jnp.int32(replica_id),
        }
        return ctx.all_reduce("SUM", nest), ctx.all_reduce("MEAN", [nest["scalar"], nest["vector"]])

    total = n * (n - 1) / 2.0
    mean = (n - 1.0) / 2.0
    for summed, averaged in strategy.experimental_local_results(strategy.run(step)):
        np.testing.assert_allclose(np.asarray(summed["scalar"]), total)
        np.testing.assert_allclose(np.asarray(summed["vector"]), np.arange(5) * n + total)
        np.testing.assert_allclose(np.asarray(summed["matrix"]), np.full((2, 3), total + n))
        assert np.asarray(summed["int"]).dtype == np.int32
        assert int(summed["int"]) == n * (n - 1) // 2
        np.testing.assert_allclose(np.asarray(averaged[0]), mean)
        np.testing.assert_allclose(np.asarray(averaged[1]), np.arange(5) + mean)


@pytest.mark.parametrize("n", [2, 4])
def test_reduce_in_merge_call(ops, n, engine):
    # merge_call -> extended.batch_reduce_to in a replica: TF's in-graph path.
    strategy = kd.MirroredStrategy(cpus(n), cross_device_ops=ops)

    def merge_fn(s, value):
        return s.extended.batch_reduce_to("SUM", [(value, value), (value, value)])

    def step():
        ctx = kd.get_replica_context()
        d = jnp.float32(ctx.replica_id_in_sync_group) + 1.0
        first, second = ctx.merge_call(merge_fn, args=(d,))
        return first + 0.0, second + 0.0

    expected = n * (n + 1) / 2.0
    for first, second in strategy.experimental_local_results(strategy.run(step)):
        assert float(first) == expected
        assert float(second) == expected


@pytest.mark.parametrize("n", [2, 4])
def test_ops_reduce_and_broadcast_outside_any_strategy_as_tf(ops, n):
    # TF's ops work on their own: on a PerReplica's components, onto the devices named.
    devices = cpus(n)
    per_replica, _, mean, _, _ = _cases(devices)
    assert not kd.has_strategy()
    on_one = ops.reduce("SUM", per_replica, destinations="/cpu:1")
    assert not isinstance(on_one, kd.DistributedValues)
    assert _device_of(on_one) == resolve_device("/cpu:1")
    assert float(on_one) == mean * n
    _assert_mirrored(ops.reduce("MEAN", per_replica, destinations=per_replica), mean, devices)
    summed, averaged = ops.batch_reduce(
        "SUM", [(per_replica, "/cpu:0"), (per_replica, list(devices))]
    )
    assert float(summed) == mean * n
    _assert_mirrored(averaged, mean * n, devices)
    _assert_mirrored(ops.broadcast(jnp.float32(2.0), list(devices)), 2.0, devices)
    # TF's MEAN of integers is a float here too (1 and 2 give 1.5).
    ints = kd.PerReplica((jnp.int32(1), jnp.int32(2)))
    assert float(ops.reduce("MEAN", ints, destinations="/cpu:0")) == 1.5
    with pytest.raises(ValueError, match="must name the devices.*Received: destinations=None"):
        ops.reduce("SUM", per_replica, destinations=None)
