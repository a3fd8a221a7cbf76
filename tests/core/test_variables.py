"""Distributed variables, after TF's mirrored_strategy_test, vars_test and values_test.

Covered: 28, 29 (first half), 30, 31, 32, 33, 34, 35, 37, 38, 39, 40, 41.

Not covered, on purpose:

* 29, second half (ON_READ is not trainable unless ``trainable=True``): Keras's
  ``Variable`` constructor defaults ``trainable=True`` and does not tell an
  explicit ``trainable=True`` from the default, so the library cannot apply
  TF's rule. Only "an explicit ``trainable=False`` is kept" is pinned.
* 36 (scatter ops): Keras variables have no ``scatter_*`` methods.

Design decisions of keras_dist pinned here:

* A ``MirroredVariable`` holds one logical value, the same on every replica.
  Per-replica values for it (spec 41's ON_WRITE + NONE case) are refused with a
  ValueError that points to ``synchronization='on_read'``.
* Spec 33: aggregation NONE in a replica context follows TF2: allowed; every
  replica writes the same value.
* Keras variable names have no ":0" suffix (TF's "foo:0" is "foo" here).
"""

import contextlib

import jax
import jax.numpy as jnp
import keras
import numpy as np
import pytest

import keras_dist as kd
from keras_dist._devices import resolve_device
from keras_dist._values._variables import numpy_components

try:
    from conftest import cpus
except ImportError:  # pragma: no cover - conftest is always importable under pytest

    def cpus(n):
        assert len(jax.devices("cpu")) >= n
        return [f"/cpu:{i}" for i in range(n)]


AGGREGATIONS = ["none", "sum", "mean", "only_first_replica"]


def _strategy(n):
    return kd.MirroredStrategy(cpus(n))


def _components(variable):
    return [float(c) for c in numpy_components(variable)]


def _replica_id():
    """This replica's id as a float32 (a traced value in the compiled engine)."""
    return jnp.asarray(kd.get_replica_context().replica_id_in_sync_group, jnp.float32)


def _local(strategy, value):
    return [float(x) for x in strategy.experimental_local_results(value)]


def _on_write(strategy, initial, aggregation="none", **kwargs):
    with strategy.scope():
        return keras.Variable(initial, aggregation=aggregation, **kwargs)


def _on_read(strategy, initial, aggregation, **kwargs):
    with strategy.scope():
        return keras.Variable(initial, synchronization="on_read", aggregation=aggregation, **kwargs)


def _set_components(strategy, variable, values):
    """Gives replica ``i`` the value ``values[i]`` (TF: extended.update with a PerReplica)."""
    with strategy.scope():
        strategy.extended.update(
            variable, lambda v, x: v.assign(x), args=(kd.PerReplica(tuple(values)),)
        )


# --------------------------------------------------------------------------- 28


@pytest.mark.parametrize("n", [1, 2, 3])
@pytest.mark.parametrize("synchronization", ["auto", "on_write"])
def test_variable_made_in_scope_is_mirrored(n, synchronization):
    strategy = _strategy(n)
    with strategy.scope():
        v = keras.Variable(1.0, name="foo", synchronization=synchronization)
    assert isinstance(v, kd.MirroredVariable)
    assert isinstance(v, keras.Variable)
    assert v.distribute_strategy is strategy
    assert v.name == "foo"  # TF: "foo:0"; Keras names have no output index.
    assert _components(v) == [1.0] * n
    # One component per device, on the strategy's worker devices, in order.
    devices = [next(iter(c.devices())) for c in (v.component(i) for i in range(n))]
    assert devices == [resolve_device(d) for d in cpus(n)]
    assert len(strategy.extended.worker_devices) == n


def test_variable_made_in_scope_of_on_read_is_sync_on_read():
    strategy = _strategy(2)
    v = _on_read(strategy, 1.0, "sum", name="foo")
    assert isinstance(v, kd.SyncOnReadVariable)
    assert isinstance(v, keras.Variable)
    assert v.name == "foo"
    assert _components(v) == [1.0, 1.0]


def test_variable_made_outside_scope_is_plain():
    v = keras.Variable(1.0)
    assert not isinstance(v, (kd.MirroredVariable, kd.SyncOnReadVariable))


@pytest.mark.parametrize("synchronization", ["on_write", "on_read"])
@pytest.mark.parametrize("n", [2, 3])
def test_variable_made_in_replica_fn(n, synchronization, engine):
    # Created once, on the first call (TF: tf.function's singleton-variable rule;
    # the eager engine runs replica 0 first, so the others find it).
    strategy = _strategy(n)
    holder = []
    expected_class = kd.SyncOnReadVariable if synchronization == "on_read" else kd.MirroredVariable

    def fn():
        if not holder:
            holder.append(
                keras.Variable(
                    keras.initializers.Constant(1.0),
                    shape=(),
                    name="foo",
                    synchronization=synchronization,
                    aggregation="mean",
                )
            )
        # (Inside a compiled trace Keras defers the initialization, and the
        # class is given when the engine initializes it, before the real trace.)
        return holder[0].value

    result = strategy.run(fn)
    assert len(holder) == 1
    (v,) = holder
    assert isinstance(v, expected_class)
    assert v.distribute_strategy is strategy
    assert v.name == "foo"
    assert _components(v) == [1.0] * n
    assert _local(strategy, result) == [1.0] * n


@pytest.mark.parametrize("synchronization", ["on_write", "on_read"])
def test_variable_made_in_run_with_random_initializer_has_equal_components(synchronization, engine):
    # vars_test::testInitializedToSameValueInsideEagerRun (and its ON_READ twin).
    strategy = _strategy(2)
    holder = []

    def fn():
        if not holder:
            holder.append(
                keras.Variable(
                    keras.initializers.RandomNormal(),
                    shape=(),
                    synchronization=synchronization,
                    aggregation="mean",
                )
            )
        return holder[0].value

    strategy.run(fn)
    first, second = _components(holder[0])
    assert first == second


def test_variable_made_unguarded_in_replica_fn(engine):
    # mirrored_strategy_test::testThreeDevices: a variable made in the replica fn.
    strategy = _strategy(3)

    def fn():
        v = keras.Variable(keras.initializers.Constant(1.0), shape=(), name="foo")
        kd.get_replica_context().merge_call(lambda _: _)
        return v

    if engine == "compiled":
        # A function that makes a new variable on every call cannot be compiled,
        # as with tf.function ("only supports singleton tf.Variables").
        with pytest.raises(RuntimeError, match="kept creating new variables on every trace"):
            strategy.run(fn)
        return
    # Eager replicas each run the function; as TF's shared_variable_creator does,
    # replicas 1.. get replica 0's variable.
    result = strategy.run(fn)
    assert isinstance(result, kd.MirroredVariable)
    assert result.name == "foo"
    assert _components(result) == [1.0] * 3


# --------------------------------------------------------------------------- 29


@pytest.mark.parametrize("synchronization", ["auto", "on_write"])
def test_on_write_is_trainable_by_default(synchronization):
    strategy = _strategy(2)
    v = _on_write(strategy, 1.0, synchronization=synchronization)
    assert v.trainable is True
    assert (
        _on_write(strategy, 1.0, synchronization=synchronization, trainable=False).trainable
        is False
    )


def test_on_read_keeps_an_explicit_trainable_false():
    # TF's "ON_READ is not trainable by default" cannot be told from Keras's
    # constructor (see the module docstring); an explicit False is kept.
    strategy = _strategy(2)
    assert _on_read(strategy, 0.0, "sum", trainable=False).trainable is False
    assert _on_read(strategy, 0.0, "sum", trainable=True).trainable is True


# --------------------------------------------------------------------------- 30


@pytest.mark.parametrize("n", [2, 4])
def test_assign_mirrored_var_cross_replica(n):
    strategy = _strategy(n)
    v = _on_write(strategy, 1.0, name="foo")
    with strategy.scope():
        assert float(v.value) == 1.0
        assert float(v.assign(6.0)) == 6.0
    assert float(v.value) == 6.0
    assert _components(v) == [6.0] * n


@pytest.mark.parametrize("n", [2, 4])
def test_assign_add_mirrored_var_cross_replica(n):
    strategy = _strategy(n)
    v = _on_write(strategy, 1.0, name="foo")
    with strategy.scope():
        # TF's read_value=True: the new value is returned.
        assert float(v.assign_add(6.0)) == 7.0
        assert _components(v) == [7.0] * n
        # TF's read_value=False: Keras has no such argument; the write is the same.
        v.assign_add(2.0)
        assert _components(v) == [9.0] * n
    assert float(v.value) == 9.0


@pytest.mark.parametrize("n", [2, 4])
def test_assign_sub_mirrored_var_cross_replica(n):
    strategy = _strategy(n)
    v = _on_write(strategy, 5.0, name="foo")
    with strategy.scope():
        assert float(v.value) == 5.0
        assert float(v.assign_sub(2.0)) == 3.0
        assert _components(v) == [3.0] * n


@pytest.mark.parametrize("n", [2, 4])
def test_assign_mirrored_var_out_of_scope(n):
    # vars_test::testAssignOutOfScope.
    strategy = _strategy(n)
    v = _on_write(strategy, 1.0)
    v.assign(3.0)
    assert float(v.value) == 3.0
    assert _components(v) == [3.0] * n


# --------------------------------------------------------------------------- 31


@pytest.mark.parametrize("n", [2, 4])
@pytest.mark.parametrize(
    "kind, initial, expected",
    [
        # replica i writes i; MEAN of 0..n-1 is (n-1)/2.
        ("assign", 1.0, lambda n: (n - 1) / 2),
        ("assign_add", 1.0, lambda n: 1.0 + (n - 1) / 2),
        ("assign_sub", 5.0, lambda n: 5.0 - (n - 1) / 2),
    ],
)
def test_mean_mirrored_var_replica_context_with_replica_id(n, kind, initial, expected, engine):
    strategy = _strategy(n)
    v = _on_write(strategy, initial, aggregation="mean", name="foo")
    assert float(v.value) == initial
    strategy.run(lambda: getattr(v, kind)(_replica_id()))
    assert float(v.value) == expected(n)  # n=2: 0.5, 1.5, 4.5 as in TF
    assert _components(v) == [expected(n)] * n


@pytest.mark.parametrize("n", [2, 4])
@pytest.mark.parametrize(
    "kind, initial, value, expected",
    [("assign", 1.0, 5.0, 5.0), ("assign_add", 1.0, 5.0, 6.0), ("assign_sub", 5.0, 1.0, 4.0)],
)
def test_mean_mirrored_var_replica_context_with_single_value(
    n, kind, initial, value, expected, engine
):
    strategy = _strategy(n)
    v = _on_write(strategy, initial, aggregation="mean", name="foo")
    results = strategy.run(lambda: getattr(v, kind)(value))
    assert float(v.value) == expected
    assert _components(v) == [expected] * n
    # Every replica gets the updated value back.
    assert _local(strategy, results) == [expected] * n


# --------------------------------------------------------------------------- 32


@pytest.mark.parametrize("n", [2, 4])
def test_sum_mirrored_var_replica_context_python_scalar_raises(n, engine):
    strategy = _strategy(n)
    v = _on_write(strategy, 1.0, aggregation="sum", name="foo")
    with pytest.raises(
        ValueError,
        match=r"A non-DistributedValues value 5\.0 cannot be reduced with the given "
        r"reduce op ReduceOp\.SUM\.",
    ):
        strategy.run(lambda: v.assign(5.0))
    assert _components(v) == [1.0] * n


def test_sum_mirrored_var_replica_context_python_scalar_one_replica(engine):
    # With one replica there is nothing to reduce: TF returns the value as is.
    strategy = _strategy(1)
    v = _on_write(strategy, 1.0, aggregation="sum")
    strategy.run(lambda: v.assign(5.0))
    assert _components(v) == [5.0]


@pytest.mark.parametrize("n", [2, 4])
def test_sum_mirrored_var_replica_context_tensor_is_summed(n, engine):
    strategy = _strategy(n)
    v = _on_write(strategy, 0.0, aggregation="sum")
    strategy.run(lambda: v.assign(_replica_id() + 1.0))
    assert _components(v) == [n * (n + 1) / 2] * n


# --------------------------------------------------------------------------- 33


@pytest.mark.parametrize("n", [1, 2, 4])
def test_none_mirrored_var_replica_context_assign(n, engine):
    # TF2: allowed, every replica writes the same value (TF1 raised "You must
    # specify an aggregation method to update a MirroredVariable in Replica Context").
    strategy = _strategy(n)
    v = _on_write(strategy, 1.0, aggregation="none", name="foo")
    results = strategy.run(lambda: v.assign(5.0))
    assert float(v.value) == 5.0
    assert _components(v) == [5.0] * n
    assert _local(strategy, results) == [5.0] * n


@pytest.mark.parametrize("n", [2, 4])
def test_none_mirrored_var_replica_context_add_and_sub(n, engine):
    strategy = _strategy(n)
    v = _on_write(strategy, 1.0)
    strategy.run(lambda: v.assign_add(5.0))
    assert _components(v) == [6.0] * n
    strategy.run(lambda: v.assign_sub(2.0))
    assert _components(v) == [4.0] * n


# --------------------------------------------------------------------------- 34


@pytest.mark.parametrize("n", [2, 4])
def test_only_first_replica_aggregation(n, engine):
    strategy = _strategy(n)
    v = _on_write(strategy, 15.0, aggregation="only_first_replica", synchronization="on_write")
    results = strategy.run(lambda: v.assign(_replica_id()))
    # The per-replica values always match the first replica's.
    assert _local(strategy, results) == [0.0] * n
    assert _components(v) == [0.0] * n


# --------------------------------------------------------------------------- 35

UPDATES = [("assign", 1.0), ("assign_add", 1.0), ("assign_sub", -1.0)]


@pytest.mark.parametrize("n", [2, 4])
@pytest.mark.parametrize("aggregation", AGGREGATIONS)
@pytest.mark.parametrize("kind, value", UPDATES)
def test_on_write_assign_cross_replica(n, aggregation, kind, value):
    strategy = _strategy(n)
    v = _on_write(strategy, 0.0, aggregation=aggregation)
    with strategy.scope():
        getattr(v, kind)(value)
    assert _components(v) == [1.0] * n


@pytest.mark.parametrize("n", [2, 4])
@pytest.mark.parametrize("aggregation", ["none", "mean", "only_first_replica"])
@pytest.mark.parametrize("kind, value", UPDATES)
def test_on_write_assign_replica(n, aggregation, kind, value, engine):
    # Replica context + SUM is skipped as in TF (a Python scalar cannot be summed; 32).
    strategy = _strategy(n)
    v = _on_write(strategy, 0.0, aggregation=aggregation)
    strategy.run(lambda: getattr(v, kind)(value))
    assert _components(v) == [1.0] * n


@pytest.mark.parametrize("n", [2, 4])
@pytest.mark.parametrize(
    "aggregation, expected",
    # SUM adds every replica's 2; the others keep 2. NONE follows spec 33's rule.
    [("sum", lambda n: 2.0 * n), ("mean", lambda n: 2.0), ("only_first_replica", lambda n: 2.0),
     ("none", lambda n: 2.0)],
)  # fmt: skip
@pytest.mark.parametrize(
    "kind, value", [("assign", 2.0), ("assign_add", 2.0), ("assign_sub", -2.0)]
)
def test_on_write_assign_per_replica_value_in_replica(
    n, aggregation, expected, kind, value, engine
):
    strategy = _strategy(n)
    v = _on_write(strategy, 0.0, aggregation=aggregation)
    per_replica = kd.PerReplica(tuple(jnp.float32(value) for _ in range(n)))
    strategy.run(lambda x: getattr(v, kind)(x), args=(per_replica,))
    assert _components(v) == [expected(n)] * n


# --------------------------------------------------------------------------- 37


@pytest.mark.parametrize("n", [2, 4])
def test_sync_on_read_sum_assign(n):
    strategy = _strategy(n)
    v = _on_read(strategy, 1.0, "sum")
    assert isinstance(v, kd.SyncOnReadVariable)
    # Every replica holds 1.0; a cross-replica read sums them.
    assert _components(v) == [1.0] * n
    assert float(v.value) == n
    with strategy.scope():
        assert float(v.value) == n
        # 6.0 is split between the replicas: 6/n each, read back as 6.
        v.assign(6.0)
        assert _components(v) == [6.0 / n] * n
        assert float(v.value) == 6.0
    assert float(v.value) == 6.0


@pytest.mark.parametrize("n", [2, 4])
@pytest.mark.parametrize("aggregation", ["sum", "mean"])
def test_extended_update_of_sync_on_read_with_a_plain_value_runs_on_each_component(n, aggregation):
    # TF 2.21, MirroredStrategy(2), SUM: extended.update(v, assign, args=(5.,)) gives
    # components [5, 5] and a read of 10 (fn runs on each component variable).
    strategy = _strategy(n)
    v = _on_read(strategy, 0.0, aggregation)
    strategy.extended.update(v, lambda var, x: var.assign(x), args=(5.0,))
    assert _components(v) == [5.0] * n
    assert float(strategy.extended.read_var(v)) == (5.0 * n if aggregation == "sum" else 5.0)


@pytest.mark.parametrize("n", [1, 2, 4])
def test_a_distributed_variables_values_device_and_tf_non_slot_api(n):
    # TF: v.values holds one value per replica, v.device is the primary's; the v1
    # optimizers' non-slot API (non_slot_devices, update_non_slot, read_var).
    strategy = _strategy(n)
    mirrored = _on_write(strategy, 1.0, "mean")
    on_read = _on_read(strategy, 0.0, "sum")
    _set_components(strategy, on_read, [float(i) for i in range(n)])
    assert [float(x) for x in mirrored.values] == [1.0] * n
    assert [float(x) for x in on_read.values] == [float(i) for i in range(n)]
    assert mirrored.device == on_read.device == strategy.extended.worker_devices[0]
    extended = strategy.extended
    assert extended.non_slot_devices([mirrored]) == extended.worker_devices
    assert len(extended.worker_devices) == n
    assert float(extended.read_var(on_read)) == sum(range(n))
    assert float(extended.read_var(mirrored)) == 1.0
    counter = _on_write(strategy, 0.0, "only_first_replica")
    result = extended.update_non_slot(
        extended.non_slot_devices([counter]), lambda: counter.assign_add(3.0)
    )
    assert float(jnp.asarray(result)) == 3.0
    assert _components(counter) == [3.0] * n  # one update, every replica's copy
    with pytest.raises(TypeError, match="reads a variable"):
        extended.read_var(1.0)

    def in_replica():
        extended.read_var(mirrored)

    with pytest.raises(RuntimeError, match="cross-replica context"):
        strategy.run(in_replica)


@pytest.mark.parametrize("n", [2, 4])
def test_sync_on_read_mean_assign(n):
    strategy = _strategy(n)
    v = _on_read(strategy, 1.0, "mean")
    assert float(v.value) == 1.0
    with strategy.scope():
        v.assign(6.0)
        assert _components(v) == [6.0] * n
        assert float(v.value) == 6.0


# --------------------------------------------------------------------------- 38


@pytest.mark.parametrize("n", [2, 4])
@pytest.mark.parametrize(
    "aggregation, expected",
    [
        ("sum", lambda n: n * (n - 1) / 2),
        ("mean", lambda n: (n - 1) / 2),
        ("only_first_replica", lambda n: 0.0),
    ],
)
def test_sync_on_read_read_in_cross_replica_context(n, aggregation, expected, engine):
    strategy = _strategy(n)
    v = _on_read(strategy, 0.0, aggregation)
    results = strategy.run(lambda: v.assign(_replica_id()))
    # testAssignPerReplicaBeforeRead: each replica gets its own value back.
    assert _local(strategy, results) == [float(i) for i in range(n)]
    assert _components(v) == [float(i) for i in range(n)]
    assert float(v.value) == expected(n)
    assert float(v.numpy()) == expected(n)
    assert float(np.asarray(v)) == expected(n)
    with strategy.scope():
        assert float(v.value) == expected(n)
        assert float(v + 0.0) == expected(n)


@pytest.mark.parametrize("n", [2, 4])
@pytest.mark.parametrize("aggregation", ["none", "sum", "mean", "only_first_replica"])
def test_sync_on_read_read_in_replica_context(n, aggregation, engine):
    strategy = _strategy(n)
    v = _on_read(strategy, 0.0, aggregation)
    strategy.run(lambda: v.assign(_replica_id()))
    # In a replica, each replica sees its own component.
    assert _local(strategy, strategy.run(lambda: v.value)) == [float(i) for i in range(n)]
    assert _local(strategy, strategy.run(lambda: v + 0.0)) == [float(i) for i in range(n)]


class _Seen(keras.metrics.Metric):
    """A metric with a variable of aggregation "none" (Keras allows it)."""

    def __init__(self):
        super().__init__(name="seen")
        self.total = self.add_variable(shape=(), initializer="zeros", name="total")
        self.flag = self.add_variable(
            shape=(), initializer="zeros", name="flag", aggregation="none"
        )

    def update_state(self, y_true, y_pred, sample_weight=None):
        self.total.assign_add(keras.ops.sum(keras.ops.abs(y_true - y_pred)))
        self.flag.assign(1.0)

    def result(self):
        return self.total * self.flag


def _evaluate_seen(strategy):
    with strategy.scope() if strategy else contextlib.nullcontext():
        model = keras.Sequential(
            [keras.Input((3,)), keras.layers.Dense(1, kernel_initializer="ones")]
        )
        model.compile(optimizer="sgd", loss="mse", metrics=[_Seen()])
    x, y = np.ones((8, 3), "float32"), np.zeros((8, 1), "float32")
    return model.evaluate(x, y, batch_size=4, verbose=0, return_dict=True)


def test_one_device_reads_an_aggregation_none_variable_as_plain_keras():
    # TF's OneDeviceStrategy keeps plain variables; plain Keras gives {loss 9, seen 24}.
    assert _evaluate_seen(None) == {"loss": 9.0, "seen": 24.0}
    assert _evaluate_seen(kd.OneDeviceStrategy("/cpu:0")) == {"loss": 9.0, "seen": 24.0}
    strategy = kd.OneDeviceStrategy("/cpu:0")
    v = _on_read(strategy, 3.0, "none")
    assert float(v.value) == 3.0
    # Several replicas cannot read it, as in TF; the error says what to create instead.
    with pytest.raises(ValueError, match=r"NONE.*Create it with aggregation='sum'"):
        _evaluate_seen(_strategy(2))


@pytest.mark.parametrize("n", [1, 2])
def test_sync_on_read_none_cross_replica_read_raises(n):
    strategy = _strategy(n)
    v = _on_read(strategy, 0.0, "none")
    with pytest.raises(ValueError, match=r"Could not convert from .* VariableAggregation\.NONE"):
        v.value  # noqa: B018
    with strategy.scope():
        with pytest.raises(
            ValueError, match=r"Could not convert from .* VariableAggregation\.NONE"
        ):
            v.numpy()


# --------------------------------------------------------------------------- 39


@pytest.mark.parametrize("n", [1, 2, 4])
@pytest.mark.parametrize("kind, sign", [("assign_add", 1.0), ("assign_sub", -1.0)])
def test_sync_on_read_sum_add_sub_cross_replica_moves_the_total(n, kind, sign):
    # TF raises here; Keras 3 updates metric totals outside any replica, so the first
    # replica's component takes the change and the total is one device's (docs/differences.md).
    strategy = _strategy(n)
    v = _on_read(strategy, 2.0 * n, "sum")
    with strategy.scope():
        v.assign(2.0 * n)
        getattr(v, kind)(3.0)
    assert float(v.value) == 2.0 * n + sign * 3.0
    assert _components(v) == [2.0 + sign * 3.0] + [2.0] * (n - 1)


def test_metric_updated_outside_fit_matches_one_device():
    y_true = np.array([[1.0], [2.0], [3.0]])
    y_pred = np.array([[1.5], [2.0], [2.0]])
    plain = keras.metrics.MeanSquaredError()
    plain.update_state(y_true, y_pred)
    strategy = _strategy(4)
    with strategy.scope():
        metric = keras.metrics.MeanSquaredError()
    metric.update_state(y_true, y_pred)
    metric.update_state(y_true, y_pred)
    plain.update_state(y_true, y_pred)
    assert float(metric.result()) == pytest.approx(float(plain.result()), abs=1e-7)
    assert float(metric.result()) == pytest.approx(1.25 / 3, abs=1e-7)


@pytest.mark.parametrize("n", [1, 2, 4])
def test_sync_on_read_sum_assign_total(n):
    strategy = _strategy(n)
    v = _on_read(strategy, 0.0, "sum")
    with strategy.scope():
        v.assign(1.0 * n)
    assert _components(v) == [1.0] * n
    assert float(v.value) == n


@pytest.mark.parametrize("n", [2, 4])
def test_sync_on_read_mean_operator_override(n, engine):
    strategy = _strategy(n)
    v = _on_read(strategy, 0.0, "mean")
    strategy.run(lambda: v.assign(_replica_id()))
    with strategy.scope():
        assert float(v + 1) == (n - 1) / 2 + 1  # n=2: 1.5
    assert _local(strategy, strategy.run(lambda: v + 1)) == [i + 1.0 for i in range(n)]


@pytest.mark.parametrize("n", [2, 4])
@pytest.mark.parametrize("aggregation", ["mean", "only_first_replica"])
@pytest.mark.parametrize("kind, value", UPDATES)
def test_sync_on_read_assign_cross_replica(n, aggregation, kind, value):
    # vars_test::testAssignDtypeConversion's cross-replica half: every component 1.
    strategy = _strategy(n)
    v = _on_read(strategy, 0.0, aggregation)
    with strategy.scope():
        getattr(v, kind)(value)
    assert _components(v) == [1.0] * n


@pytest.mark.parametrize("n", [2, 4])
@pytest.mark.parametrize("aggregation", AGGREGATIONS)
@pytest.mark.parametrize("kind, value", UPDATES)
def test_sync_on_read_assign_replica(n, aggregation, kind, value, engine):
    # ... and its replica half: each replica writes its own component.
    strategy = _strategy(n)
    v = _on_read(strategy, 0.0, aggregation)
    strategy.run(lambda: getattr(v, kind)(value))
    assert _components(v) == [1.0] * n


# --------------------------------------------------------------------------- 40


def test_checkpoint_sync_on_read_sum():
    strategy = _strategy(2)
    v = _on_read(strategy, 0.0, "sum")
    _set_components(strategy, v, [3.0, 4.0])
    assert _components(v) == [3.0, 4.0]
    saved = v.numpy()  # what a checkpoint stores: the aggregated value
    assert float(saved) == 7.0
    assert float(np.asarray(v)) == 7.0
    v.assign(0.0)
    with strategy.scope():
        v.assign(saved)  # restore, in cross-replica context
    assert _components(v) == [3.5, 3.5]
    assert float(v.value) == 7.0


def test_checkpoint_sync_on_read_mean():
    strategy = _strategy(2)
    v = _on_read(strategy, 0.0, "mean")
    _set_components(strategy, v, [3.0, 4.0])
    saved = v.numpy()
    assert float(saved) == 3.5
    v.assign(0.0)
    with strategy.scope():
        v.assign(saved)
    assert _components(v) == [3.5, 3.5]


def test_checkpoint_sync_on_read_sum_restores_into_plain_and_sum_vars():
    strategy = _strategy(2)
    v = _on_read(strategy, 0.0, "sum")
    _set_components(strategy, v, [1.5, 2.0])
    saved = v.numpy()
    assert float(saved) == 3.5
    plain = keras.Variable(0.0)
    plain.assign(saved)
    assert float(plain.value) == 3.5
    other = _on_read(strategy, 0.0, "sum")
    with strategy.scope():
        other.assign(saved)
    assert _components(other) == [1.75, 1.75]


@pytest.mark.parametrize("n", [2, 4])
def test_checkpoint_mirrored(n):
    # TF: a Mirrored [3, 4] saves its primary, 3, and restores as [3, 3]. Here a
    # MirroredVariable cannot hold different components (one logical value), so
    # it saves that value and restores it on every replica.
    strategy = _strategy(n)
    v = _on_write(strategy, 3.0)
    saved = v.numpy()
    assert float(saved) == 3.0
    v.assign(4.0)
    with strategy.scope():
        v.assign(saved)
    assert _components(v) == [3.0] * n
    # A plain variable's checkpoint restores into a mirrored one, and back.
    plain = keras.Variable(5.0)
    v.assign(plain.numpy())
    assert _components(v) == [5.0] * n
    plain.assign(np.asarray(v))
    assert float(plain.value) == 5.0


class _Counter(keras.layers.Layer):
    """A layer with a SyncOnRead SUM weight (as a metric keeps its totals)."""

    def build(self, input_shape):
        self.total = keras.Variable(
            0.0, synchronization="on_read", aggregation="sum", trainable=False, name="total"
        )
        self.dense = keras.layers.Dense(1, kernel_initializer="ones")
        self.dense.build(input_shape)

    def call(self, x):
        return self.dense(x)


def _model():
    return keras.Sequential([keras.Input((3,)), _Counter()])


@pytest.mark.parametrize("n", [2, 4])
def test_keras_save_and_load_weights_with_sync_on_read_variable(n, tmp_path):
    strategy = _strategy(n)
    with strategy.scope():
        model = _model()
    layer = model.layers[0]
    assert isinstance(layer.total, kd.SyncOnReadVariable)
    assert isinstance(layer.dense.kernel, kd.MirroredVariable)
    _set_components(strategy, layer.total, [3.0, 4.0] + [0.0] * (n - 2))
    layer.dense.kernel.assign(np.full((3, 1), 2.0, np.float32))
    path = str(tmp_path / "model.weights.h5")
    model.save_weights(path)

    layer.total.assign(0.0)
    layer.dense.kernel.assign(np.zeros((3, 1), np.float32))
    model.load_weights(path)
    assert _components(layer.total) == [7.0 / n] * n
    assert float(layer.total.value) == 7.0
    np.testing.assert_array_equal(np.asarray(layer.dense.kernel), np.full((3, 1), 2.0))
    for component in numpy_components(layer.dense.kernel):
        np.testing.assert_array_equal(component, np.full((3, 1), 2.0))

    # The saved value is the aggregated one: a model without a strategy reads 7.
    plain = _model()
    plain.load_weights(path)
    assert not isinstance(plain.layers[0].total, kd.SyncOnReadVariable)
    assert float(plain.layers[0].total.value) == 7.0

    # And a plain model's weights load into a model of another strategy.
    plain_path = str(tmp_path / "plain.weights.h5")
    plain.save_weights(plain_path)
    other_strategy = _strategy(2)
    with other_strategy.scope():
        other = _model()
    other.load_weights(plain_path)
    assert _components(other.layers[0].total) == [3.5, 3.5]


def test_keras_metric_variables_are_sync_on_read(engine):
    strategy = _strategy(2)
    with strategy.scope():
        metric = keras.metrics.Sum()
    (total,) = metric.variables
    assert isinstance(total, kd.SyncOnReadVariable)
    strategy.run(lambda x: metric.update_state(x), args=(kd.PerReplica((1.0, 2.0)),))
    assert _components(total) == [1.0, 2.0]
    assert float(metric.result()) == 3.0


# --------------------------------------------------------------------------- 41


@pytest.mark.parametrize("n", [2, 4])
@pytest.mark.parametrize("aggregation", ["mean", "sum", "only_first_replica"])
def test_extended_update_on_read(n, aggregation):
    strategy = _strategy(n)
    v = _on_read(strategy, 0.0, aggregation)
    value = kd.PerReplica(tuple(float(i + 1) for i in range(n)))  # n=2: [1, 2]
    base = [float(i + 1) for i in range(n)]
    with strategy.scope():
        strategy.extended.update(v, lambda var, x: var.assign(x), args=(value,))
        assert _components(v) == base
        strategy.extended.update(v, lambda var, x: var.assign_add(x), args=(value,))
        assert _components(v) == [2 * b for b in base]
        strategy.extended.update(v, lambda var, x: var.assign_sub(x), args=(value,))
        assert _components(v) == base
        # Inside update, each replica's reads see its own component.
        strategy.extended.update(
            v, lambda var, x: var.assign_add(var.value + var.numpy()), args=(value,)
        )
        assert _components(v) == [3 * b for b in base]


@pytest.mark.parametrize("n", [2, 4])
@pytest.mark.parametrize("aggregation", ["mean", "sum", "only_first_replica", "none"])
def test_extended_update_on_read_in_merge_call(n, aggregation, engine):
    # The same update reached from a replica through merge_call (the in-replica path).
    strategy = _strategy(n)
    v = _on_read(strategy, 0.0, aggregation)

    def merge_fn(s, x):
        return s.extended.update(v, lambda var, y: var.assign(y), args=(x,))

    strategy.run(lambda: kd.get_replica_context().merge_call(merge_fn, args=(_replica_id() + 1.0,)))
    assert _components(v) == [float(i + 1) for i in range(n)]


@pytest.mark.parametrize("n", [2, 4])
def test_extended_update_on_write_none_with_per_replica_raises(n):
    # keras_dist design: a MirroredVariable holds one value for every replica.
    strategy = _strategy(n)
    v = _on_write(strategy, 0.0, aggregation="none")
    value = kd.PerReplica(tuple(float(i + 1) for i in range(n)))
    with strategy.scope():
        with pytest.raises(ValueError, match="synchronization='on_read'"):
            strategy.extended.update(v, lambda var, x: var.assign(x), args=(value,))
        with pytest.raises(ValueError, match="synchronization='on_read'"):
            v.assign(value)
        with pytest.raises(ValueError, match="synchronization='on_read'"):
            v.assign_add(value)
    assert _components(v) == [0.0] * n


@pytest.mark.parametrize("n", [2, 4])
def test_extended_update_on_write_with_mirrored_value(n):
    # A Mirrored (one value) is fine for a MirroredVariable.
    strategy = _strategy(n)
    v = _on_write(strategy, 0.0)
    with strategy.scope():
        value = strategy.extended.broadcast_to(jnp.float32(2.0), None)
        strategy.extended.update(v, lambda var, x: var.assign(x), args=(value,))
        assert _components(v) == [2.0] * n
        strategy.extended.update(v, lambda var, x: var.assign_add(x), args=(value,))
        assert _components(v) == [4.0] * n


def test_variable_created_in_scope_is_tfs():
    # TF 2.21: a MirroredStrategy's own variable True, one made outside False; the default
    # strategy owns the variables no strategy created.
    first, second = kd.MirroredStrategy(cpus(2)), kd.MirroredStrategy(cpus(2))
    with first.scope():
        mine = keras.Variable(1.0)
    plain = keras.Variable(2.0)
    assert first.extended.variable_created_in_scope(mine)
    assert not first.extended.variable_created_in_scope(plain)
    assert not second.extended.variable_created_in_scope(mine)
    default = kd.get_strategy().extended
    assert default.variable_created_in_scope(plain)
    assert not default.variable_created_in_scope(mine)


@pytest.mark.parametrize("n", [1, 2, 4])
def test_cross_replica_assign_of_an_integer_sum_variable_reads_back_exactly(n):
    # Keras 3's metrics assign their integer totals (IoU's confusion matrix, a count):
    # TF's split (value / replicas on each) truncated them: 10 read back as 8 on 4
    # replicas, a matrix of ones as zeros, and 19000003 as 19000004 through a float.
    strategy = _strategy(n)
    count = _on_read(strategy, np.int32(0), "sum")
    with strategy.scope():
        count.assign(count.value + 10)
        assert int(count.value) == 10
        count.assign(np.int32(19_000_003))
    assert int(count.value) == 19_000_003
    assert [int(c) for c in numpy_components(count)] == [19_000_003] + [0] * (n - 1)
    with strategy.scope():
        iou = keras.metrics.IoU(num_classes=2, target_class_ids=[0, 1])
        in_scope = float(iou([0, 0, 1, 1], [0, 1, 0, 1]))
        matrix = np.asarray(iou.total_cm.value)
    plain = keras.metrics.IoU(num_classes=2, target_class_ids=[0, 1])
    assert in_scope == float(plain([0, 0, 1, 1], [0, 1, 0, 1])) == pytest.approx(1 / 3)
    np.testing.assert_array_equal(matrix, [[1, 1], [1, 1]])
