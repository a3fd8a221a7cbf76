"""Scope and context (from TF's distribute_lib_test.py and strategy_common_test.py)."""

import keras
import numpy as np
import pytest
from conftest import cpus

import keras_dist as kd
from keras_dist.strategies._default import default_strategy

_MIXING = "Mixing different tf.distribute.Strategy objects"
_SET_IN_SCOPE = "Must not be called inside a `tf.distribute.Strategy` scope"

STRATEGIES = {
    "one_device": lambda: kd.OneDeviceStrategy("/cpu:0"),
    "mirrored1": lambda: kd.MirroredStrategy(cpus(1)),
    "mirrored2": lambda: kd.MirroredStrategy(cpus(2)),
    "mirrored4": lambda: kd.MirroredStrategy(cpus(4)),
}


@pytest.fixture(params=sorted(STRATEGIES))
def strategy(request):
    return STRATEGIES[request.param]()


def _assert_in_default_state():
    """TF's `_assert_in_default_state`."""
    default = default_strategy()
    replica_context = kd.get_replica_context()
    assert replica_context is not None
    assert replica_context is default.extended._default_replica_context
    assert kd.get_cross_replica_context() is None
    assert not kd.in_cross_replica_context()
    assert kd.get_strategy() is default
    assert not kd.has_strategy()


# ---------------------------------------------------------------- 1. default state
def test_default_state_outside_any_scope():
    _assert_in_default_state()
    default = kd.get_strategy()
    assert kd.get_strategy() is default  # one process-wide default strategy
    assert default.num_replicas_in_sync == 1
    assert kd.get_replica_context().num_replicas_in_sync == 1
    assert kd.get_replica_context().replica_id_in_sync_group == 0


# ---------------------------------------------------------------------- 2. scope
def test_scope_enters_cross_replica_context_and_restores_defaults(strategy):
    with strategy.scope() as entered:
        assert entered is strategy
        assert kd.get_replica_context() is None
        assert kd.get_cross_replica_context() is strategy
        assert kd.in_cross_replica_context()
        assert kd.has_strategy()
        assert kd.get_strategy() is strategy
    _assert_in_default_state()


def test_scope_restores_defaults_when_body_raises(strategy):
    with pytest.raises(KeyError):
        with strategy.scope():
            raise KeyError("boom")
    _assert_in_default_state()


# ------------------------------------------------------- 3. inside a replica fn
@pytest.mark.parametrize("in_scope", [False, True], ids=["no_scope", "in_scope"])
def test_replica_context_inside_run(strategy, engine, in_scope):
    seen = []

    def fn():
        context = kd.get_replica_context()
        seen.append(
            (
                context is not None,
                context.strategy if context is not None else None,
                context.num_replicas_in_sync if context is not None else None,
                kd.get_cross_replica_context(),
                kd.in_cross_replica_context(),
                kd.has_strategy(),
                kd.get_strategy(),
            )
        )
        return 1.0

    n = strategy.num_replicas_in_sync
    if in_scope:
        with strategy.scope():
            strategy.run(fn)
            assert kd.get_cross_replica_context() is strategy
    else:
        strategy.run(fn)
    # Compiled: traced once for all replicas; eager: once per replica thread.
    assert len(seen) == (n if engine == "eager" else 1)
    assert all(s == (True, strategy, n, None, False, True, strategy) for s in seen)
    _assert_in_default_state()


def test_replica_context_inside_call_for_each_replica(strategy, engine):
    seen = []

    def fn():
        seen.append(
            (
                kd.get_replica_context() is not None,
                kd.get_cross_replica_context(),
                kd.get_strategy(),
                kd.has_strategy(),
            )
        )
        return kd.get_replica_context().replica_id_in_sync_group

    with strategy.scope():
        out = strategy.extended.call_for_each_replica(fn)
        assert kd.get_replica_context() is None  # back in cross-replica context
    assert seen and all(s == (True, None, strategy, True) for s in seen)
    n = strategy.num_replicas_in_sync
    assert [int(x) for x in strategy.experimental_local_results(out)] == list(range(n))


def test_default_strategy_run_uses_default_replica_context():
    default = default_strategy()
    seen = []

    def fn(x):
        seen.append(kd.get_replica_context())
        return x + 1

    assert default.run(fn, args=(41,)) == 42
    assert default.extended.call_for_each_replica(fn, args=(1,)) == 2
    assert seen == [default.extended._default_replica_context] * 2
    _assert_in_default_state()


# --------------------------------------------------------------- 4. nesting
def test_same_scope_nesting_is_allowed():
    # TF's testSameScopeNesting: the same scope object may be re-entered.
    strategy = kd.MirroredStrategy(cpus(2))
    scope_a = strategy.scope()
    with scope_a:
        assert kd.get_strategy() is strategy
        scope_b = strategy.scope()
        with scope_b:
            assert kd.get_strategy() is strategy
            with scope_a:
                assert kd.get_strategy() is strategy
                assert kd.get_cross_replica_context() is strategy
            assert kd.get_strategy() is strategy
        assert kd.get_strategy() is strategy
    _assert_in_default_state()


def test_nesting_another_strategys_scope_raises():
    first = kd.MirroredStrategy(cpus(2))
    second = kd.MirroredStrategy(cpus(2))
    one = kd.OneDeviceStrategy("/cpu:0")
    for outer, inner in ((first, second), (first, one), (one, first)):
        with outer.scope():
            with pytest.raises(RuntimeError, match=_MIXING):
                with inner.scope():
                    pass
            # The failed entry left the outer scope intact.
            assert kd.get_strategy() is outer
            assert kd.get_cross_replica_context() is outer
        _assert_in_default_state()


def test_default_scope_is_mostly_a_no_op():
    # TF's testScopeMostlyNoOp: the default strategy's scope keeps the default
    # state, may be nested, and a variable created in another strategy's scope
    # inside it raises.
    other = kd.MirroredStrategy(cpus(2))
    with other.scope():
        before = keras.Variable(1.0, name="before")
    assert isinstance(before, kd.MirroredVariable)

    default = default_strategy()
    scope = default.scope()
    with scope:
        _assert_in_default_state()
        with pytest.raises(RuntimeError, match=_MIXING):
            with other.scope():
                keras.Variable(1.0, name="error")
        with scope:
            _assert_in_default_state()
            with pytest.raises(RuntimeError, match=_MIXING):
                with other.scope():
                    keras.Variable(1.0, name="also_error")
        _assert_in_default_state()
    _assert_in_default_state()

    with other.scope():
        after = keras.Variable(1.0, name="after")
    assert isinstance(after, kd.MirroredVariable)
    assert float(after.value) == 1.0


# ------------------------------------------------- 5. experimental_set_strategy
def test_set_strategy_acts_like_entering_the_scope():
    first = kd.MirroredStrategy(cpus(2))
    second = kd.OneDeviceStrategy("/cpu:0")
    _assert_in_default_state()
    kd.experimental_set_strategy(first)
    assert kd.get_replica_context() is None
    assert kd.get_cross_replica_context() is first
    assert kd.in_cross_replica_context()
    assert kd.has_strategy()
    assert kd.get_strategy() is first
    v = keras.Variable(1.0, name="test")
    assert isinstance(v, kd.MirroredVariable)
    assert v.distribute_strategy is first
    kd.experimental_set_strategy(second)
    assert kd.get_strategy() is second
    assert kd.get_cross_replica_context() is second
    kd.experimental_set_strategy(None)
    _assert_in_default_state()


def test_set_strategy_allows_entering_its_own_scope():
    strategy = kd.MirroredStrategy(cpus(2))
    kd.experimental_set_strategy(strategy)
    with strategy.scope():
        assert kd.get_strategy() is strategy
    assert kd.get_strategy() is strategy
    kd.experimental_set_strategy(None)
    _assert_in_default_state()


def test_set_strategy_inside_a_scope_raises():
    strategy = kd.MirroredStrategy(cpus(2))
    with strategy.scope():
        for target in (kd.MirroredStrategy(cpus(2)), strategy, None):
            with pytest.raises(RuntimeError, match=_SET_IN_SCOPE):
                kd.experimental_set_strategy(target)
        assert kd.get_strategy() is strategy
    _assert_in_default_state()


def test_set_strategy_inside_a_scope_entered_after_it_raises():
    strategy = kd.MirroredStrategy(cpus(2))
    kd.experimental_set_strategy(strategy)
    with strategy.scope():
        with pytest.raises(RuntimeError, match=_SET_IN_SCOPE):
            kd.experimental_set_strategy(None)
    kd.experimental_set_strategy(None)
    _assert_in_default_state()


# ------------------------------------------------ 6. default ctx merge_call
def test_default_replica_context_merge_call():
    _assert_in_default_state()
    default = default_strategy()
    seen = {}

    def merge_fn(dist, s):
        seen["dist"] = dist
        seen["replica_context"] = kd.get_replica_context()
        seen["cross_replica_context"] = kd.get_cross_replica_context()
        seen["in_cross_replica_context"] = kd.in_cross_replica_context()
        seen["strategy"] = kd.get_strategy()
        seen["has_strategy"] = kd.has_strategy()
        return "foo_" + s

    replica_context = kd.get_replica_context()
    assert replica_context is default.extended._default_replica_context
    assert replica_context.merge_call(merge_fn, args=("bar",)) == "foo_bar"
    assert seen == {
        "dist": default,
        "replica_context": None,
        "cross_replica_context": default,
        "in_cross_replica_context": True,
        "strategy": default,
        "has_strategy": False,
    }
    _assert_in_default_state()


def test_default_replica_context_merge_call_kwargs():
    result = kd.get_replica_context().merge_call(
        lambda dist, a, b: (a, b), args=(1,), kwargs={"b": 2}
    )
    assert result == (1, 2)


# --------------------------------------------- 7. string ops and local results
OPS = ("mean", "MEAN", "sum", "SUM")


@pytest.mark.parametrize("op", OPS)
def test_default_strategy_reductions_accept_string_ops(op):
    default = default_strategy()
    assert float(default.reduce(op, 1.0, axis=None)) == 1.0
    assert float(default.extended.reduce_to(op, 1.0, None)) == 1.0
    assert [float(x) for x in default.extended.batch_reduce_to(op, [(1.0, None), (2.0, None)])] == [
        1.0,
        2.0,
    ]


def test_default_strategy_reduce_and_local_results():
    default = default_strategy()
    assert float(default.reduce(kd.ReduceOp.MEAN, 1.0, axis=None)) == 1.0
    plain = np.array([1.0, 2.0])
    (local,) = default.experimental_local_results(plain)
    assert local is plain
    assert default.experimental_local_results(3.0) == (3.0,)


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("n", [1, 2, 4])
def test_mirrored_reductions_accept_string_ops(op, n):
    strategy = kd.MirroredStrategy(cpus(n))
    value = strategy.experimental_distribute_values_from_function(
        lambda ctx: np.float32(2 * ctx.replica_id_in_sync_group + 1)
    )
    total = float(n * n)  # 1 + 3 + ... + (2n - 1)
    expected = total / n if op.upper() == "MEAN" else total
    assert float(strategy.reduce(op, value, axis=None)) == expected
    with strategy.scope():
        reduced = strategy.extended.reduce_to(op, value, value)
        assert isinstance(reduced, kd.Mirrored)
        assert [float(x) for x in strategy.experimental_local_results(reduced)] == [expected] * n
        batch = strategy.extended.batch_reduce_to(op, [(value, value), (value, value)])
        assert [[float(x) for x in strategy.experimental_local_results(r)] for r in batch] == [
            [expected] * n
        ] * 2


def test_unknown_reduce_op_raises():
    strategy = kd.MirroredStrategy(cpus(2))
    value = kd.PerReplica((np.float32(1.0), np.float32(2.0)))
    with pytest.raises(ValueError, match="Unknown reduce op"):
        strategy.reduce("max", value, axis=None)


def test_mirrored_local_results_of_plain_value(strategy):
    plain = np.array([1.0, 2.0])
    (local,) = strategy.experimental_local_results(plain)
    assert local is plain
    assert float(strategy.reduce("MEAN", 1.0, axis=None)) == 1.0


# ------------------------------------------------------------ 8. cluster_resolver
def test_cluster_resolver_is_none_on_one_host(strategy):
    assert strategy.cluster_resolver is None


def test_default_strategy_cluster_resolver_is_none():
    assert default_strategy().cluster_resolver is None


# -------------------------------------------------------------- 9. InputContext
def test_input_context():
    ctx = kd.InputContext(num_input_pipelines=2, input_pipeline_id=1, num_replicas_in_sync=6)
    assert ctx.num_replicas_in_sync == 6
    assert ctx.num_input_pipelines == 2
    assert ctx.input_pipeline_id == 1
    assert ctx.get_per_replica_batch_size(12) == 2
    with pytest.raises(
        ValueError, match="The `global_batch_size` 13 is not divisible by `num_replicas_in_sync` 6"
    ):
        ctx.get_per_replica_batch_size(13)


def test_input_context_str():
    ctx = kd.InputContext(num_input_pipelines=1, input_pipeline_id=0, num_replicas_in_sync=42)
    assert str(ctx) == "tf.distribute.InputContext(input pipeline id 0, total: 1)"
    ctx = kd.InputContext(num_input_pipelines=3, input_pipeline_id=1, num_replicas_in_sync=42)
    assert str(ctx) == "tf.distribute.InputContext(input pipeline id 1, total: 3)"


def test_value_context_str_is_tfs():
    # TF 2.21: str(tf.distribute.experimental.ValueContext(1, 4)).
    context = kd.experimental.ValueContext(replica_id_in_sync_group=1, num_replicas_in_sync=4)
    assert str(context) == "tf.distribute.ValueContext(replica id 1,  total replicas in sync: 4)"


def test_input_context_defaults():
    ctx = kd.InputContext()
    assert (ctx.num_input_pipelines, ctx.input_pipeline_id, ctx.num_replicas_in_sync) == (1, 0, 1)
    assert ctx.get_per_replica_batch_size(5) == 5


def test_clear_session_inside_a_scope_keeps_the_scope():
    # Keras's TestCase.setUp and many notebooks call clear_session() with a scope open.
    strategy = kd.MirroredStrategy(cpus(4))
    x = np.arange(30, dtype="float32").reshape(10, 3) / 30
    y = x.sum(axis=1, keepdims=True)
    with strategy.scope():
        keras.backend.clear_session()
        assert kd.get_strategy() is strategy
        model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
        assert isinstance(model.layers[0].kernel, kd.MirroredVariable)
        model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
        keras.backend.clear_session()
        # 10 rows in batches of 4: the last batch (2 rows) is partial on 4 replicas.
        history = model.fit(x, y, batch_size=4, epochs=2, verbose=0, shuffle=False)
    assert not kd.has_strategy()
    assert keras.distribution.distribution() is None

    keras.utils.set_random_seed(0)
    with strategy.scope():
        keras.backend.clear_session()
        model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
        optimizer = keras.optimizers.SGD(0.1)
    keras.utils.set_random_seed(0)
    keras.backend.clear_session()
    reference = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
    # Compiled outside the scope: a model created in one compiles in it, as in tf.keras.
    model.compile(optimizer=optimizer, loss="mse", metrics=["mae"])
    reference.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse", metrics=["mae"])
    losses = model.fit(x, y, batch_size=4, epochs=2, verbose=0, shuffle=False).history["loss"]
    expected = reference.fit(x, y, batch_size=4, epochs=2, verbose=0, shuffle=False)
    np.testing.assert_allclose(losses, expected.history["loss"], rtol=1e-5)
    assert model.metrics_variables
    assert all(isinstance(v, kd.SyncOnReadVariable) for v in model.metrics_variables)
    assert np.isfinite(history.history["loss"]).all()
