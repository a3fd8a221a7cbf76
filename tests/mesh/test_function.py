"""``kd.function``: a ported ``@tf.function`` step compiles whole, once per signature."""

import contextlib

import jax
import jax.numpy as jnp
import keras
import numpy as np
import pytest
from conftest import cpus

import keras_dist as kd
from keras_dist._engine._retracing import RetracingWarning

GLOBAL_BATCH = 32
ROWS = 178  # a partial last batch of 18 rows: 5, 5, 5, 3 on 4 replicas (TF's split)


def _data():
    rng = np.random.RandomState(0)
    x = rng.rand(ROWS, 8).astype("float32")
    y = rng.randint(0, 3, ROWS).astype("int32")
    return [(x[i : i + GLOBAL_BATCH], y[i : i + GLOBAL_BATCH]) for i in range(0, ROWS, 32)]


def _build(strategy):
    keras.utils.set_random_seed(1)
    with strategy.scope() if strategy else contextlib.nullcontext():
        model = keras.Sequential(
            [keras.Input((8,)), keras.layers.Dense(16, activation="relu"), keras.layers.Dense(3)]
        )
        optimizer = keras.optimizers.Adam(0.01)
        accuracy = keras.metrics.SparseCategoricalAccuracy()
    return model, optimizer, accuracy


# Mirrored on 4 devices, OneDevice, and the default strategy (``make_strategy()`` is None).
_EACH_STRATEGY = pytest.mark.parametrize(
    "make_strategy",
    [lambda: kd.MirroredStrategy(cpus(4)), lambda: kd.OneDeviceStrategy("/cpu:0"), lambda: None],
    ids=["mirrored", "one_device", "default"],
)

_LOSS = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction=None)


def _tutorial_step(strategy, model, optimizer, accuracy):
    """TF's custom-training tutorial's step: step_fn defined inside, a new closure each call."""

    def train_step(dist_inputs):
        def step_fn(inputs):
            images, labels = inputs

            def loss_fn():
                logits = model(images, training=True)
                loss = _LOSS(labels, logits)
                return kd.nn.compute_average_loss(loss, global_batch_size=GLOBAL_BATCH), logits

            (loss, logits), grads = kd.value_and_grad(
                loss_fn, model.trainable_variables, has_aux=True
            )()
            optimizer.apply_gradients(zip(grads, model.trainable_variables))
            accuracy.update_state(labels, logits)
            return loss

        per_replica_losses = strategy.run(step_fn, args=(dist_inputs,))
        return strategy.reduce("SUM", per_replica_losses, axis=None)

    return train_step


def _train(step, strategy, epochs=2):
    dataset = strategy.experimental_distribute_dataset(_data())
    return [float(step(batch)) for _ in range(epochs) for batch in dataset]


def test_the_tutorial_step_as_kd_function_gives_the_losses_of_one_device():
    strategy = kd.MirroredStrategy(cpus(4))
    model, optimizer, accuracy = _build(strategy)
    train_step = kd.function(_tutorial_step(strategy, model, optimizer, accuracy))
    losses = _train(train_step, strategy)
    # One program for the full batches; the partial last batch runs as Python.
    assert train_step.experimental_get_tracing_count() == 1

    one = kd.OneDeviceStrategy("/cpu:0")
    reference, ref_optimizer, ref_accuracy = _build(one)
    expected = _train(_tutorial_step(one, reference, ref_optimizer, ref_accuracy), one)
    np.testing.assert_allclose(losses, expected, rtol=1e-5)
    for got, want in zip(model.get_weights(), reference.get_weights()):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    assert int(optimizer.iterations) == int(ref_optimizer.iterations) == 12
    np.testing.assert_allclose(float(accuracy.result()), float(ref_accuracy.result()), rtol=1e-6)


def test_a_function_equals_the_same_step_without_it():
    strategy = kd.MirroredStrategy(cpus(2))
    results = []
    for decorate in (False, True):
        model, optimizer, accuracy = _build(strategy)
        step = _tutorial_step(strategy, model, optimizer, accuracy)
        step = kd.function(step) if decorate else step
        results.append((_train(step, strategy, epochs=1), model.get_weights()))
    np.testing.assert_allclose(results[0][0], results[1][0], rtol=1e-6)
    for a, b in zip(results[0][1], results[1][1]):
        np.testing.assert_allclose(a, b, rtol=1e-6)


def test_decorator_forms_methods_and_tf_arguments():
    strategy = kd.MirroredStrategy(cpus(2))
    with strategy.scope():
        counter = keras.Variable(0.0, aggregation="mean")

    class Trainer:
        @kd.function(input_signature=None, jit_compile=True, reduce_retracing=True)
        def step(self, increment):
            def replica_fn(x):
                counter.assign_add(x)
                return counter.value

            return strategy.reduce("MEAN", strategy.run(replica_fn, args=(increment,)), None)

    trainer = Trainer()
    assert float(trainer.step(np.float32(2.0))) == 2.0
    assert float(trainer.step(np.float32(3.0))) == 5.0
    assert trainer.step.experimental_get_tracing_count() == 1
    assert float(counter.value) == 5.0


def test_a_metric_read_inside_the_function_is_aggregated():
    strategy = kd.MirroredStrategy(cpus(4))
    with strategy.scope():
        mean = keras.metrics.Mean()

    @kd.function
    def step(values):
        strategy.run(lambda v: mean.update_state(v), args=(values,))
        return mean.result()

    batches = strategy.experimental_distribute_dataset([np.arange(8, dtype="float32")])
    (batch,) = list(batches)
    assert float(step(batch)) == pytest.approx(3.5)
    assert float(mean.result()) == pytest.approx(3.5)


def test_changing_shapes_retrace_and_warn():
    strategy = kd.MirroredStrategy(cpus(2))

    @kd.function
    def step(x):
        return strategy.reduce("SUM", strategy.run(lambda v: v * 2.0, args=(x,)), axis=None)

    with pytest.warns(RetracingWarning, match="new shapes or dtypes"):
        for n in range(1, 7):
            assert float(step(np.ones(n, "float32")).sum()) == 4.0 * n
    assert step.experimental_get_tracing_count() == 6


def test_a_function_taking_the_iterator_reads_one_element_per_call():
    # TF's custom-training guide: `train_step(iterator)` calls `next(iterator)` inside.
    strategy = kd.MirroredStrategy(cpus(2))
    batches = [np.full((4,), float(i), "float32") for i in range(3)]

    @kd.function
    def train_step(iterator):
        return strategy.reduce("SUM", strategy.run(lambda x: x, args=(next(iterator),)), axis=0)

    iterator = iter(strategy.experimental_distribute_dataset(batches))
    assert [float(train_step(iterator)) for _ in range(3)] == [0.0, 4.0, 8.0]
    assert train_step.experimental_get_tracing_count() == 1
    with pytest.raises(StopIteration):
        train_step(iterator)


class _Scale:
    def __init__(self, factor):
        self.factor = factor


@pytest.mark.parametrize("compiled_whole", [False, True], ids=["run", "kd.function"])
def test_a_new_python_object_argument_is_never_mistaken_for_a_freed_one(compiled_whole):
    strategy = kd.MirroredStrategy(cpus(2))

    def step(x, scale):
        return strategy.reduce(
            "SUM", strategy.run(lambda v: v * scale.factor, args=(x,)), axis=None
        )

    step = kd.function(step) if compiled_whole else step
    x = np.ones(2, "float32")
    # Each _Scale dies after its call, and the next may get its address.
    got = [float(np.sum(step(x, _Scale(float(i))))) for i in range(1, 6)]
    assert got == [4.0, 8.0, 12.0, 16.0, 20.0]


def test_a_metric_reset_inside_the_function_keeps_its_layout():
    strategy = kd.MirroredStrategy(cpus(4))
    with strategy.scope():
        mean = keras.metrics.Mean()

    @kd.function
    def step(values):
        mean.reset_state()
        strategy.run(lambda v: mean.update_state(v), args=(values,))
        return mean.result()

    (first,) = list(strategy.experimental_distribute_dataset([np.arange(8, dtype="float32")]))
    (second,) = list(strategy.experimental_distribute_dataset([np.arange(8, 16, dtype="f4")]))
    assert float(step(first)) == pytest.approx(3.5)
    assert float(step(second)) == pytest.approx(11.5)


@pytest.mark.parametrize("compiled_whole", [False, True], ids=["run", "kd.function"])
def test_a_variables_own_value_as_an_argument_is_not_donated_away(compiled_whole):
    strategy = kd.MirroredStrategy(cpus(2))
    with strategy.scope():
        w = keras.Variable(np.ones(3, "float32"), aggregation="mean")

    def step(value):
        def replica_fn(v):
            w.assign(v * 2.0)
            return v

        return strategy.reduce("SUM", strategy.run(replica_fn, args=(value,)), axis=None)

    step = kd.function(step) if compiled_whole else step
    total = step(w.value)
    np.testing.assert_array_equal(np.asarray(total), [2.0, 2.0, 2.0])
    np.testing.assert_array_equal(np.asarray(w.value), [2.0, 2.0, 2.0])


def test_a_function_helper_called_inside_a_replica_runs_inline():
    strategy = kd.MirroredStrategy(cpus(2))

    @kd.function
    def helper(x):
        return x * 2.0

    result = strategy.run(lambda: helper(np.ones((2, 2), "float32")).sum())
    assert float(strategy.reduce("SUM", result, axis=None)) == 16.0


def test_a_function_method_does_not_keep_its_instance_alive():
    import gc
    import weakref

    strategy = kd.MirroredStrategy(cpus(2))

    class Trainer:
        def __init__(self):
            with strategy.scope():
                self.w = keras.Variable(1.0, aggregation="mean")

        @kd.function
        def step(self):
            strategy.run(lambda: self.w.assign_add(1.0))
            return self.w.value

    trainer = Trainer()
    assert float(trainer.step()) == 2.0
    assert trainer.step.experimental_get_tracing_count() == 1
    alive = weakref.ref(trainer)
    del trainer
    gc.collect()
    assert alive() is None


def test_cross_replica_extended_calls_inside_a_function():
    strategy = kd.MirroredStrategy(cpus(4))
    x = np.arange(8, dtype="float32").reshape(4, 2)
    (batch,) = list(strategy.experimental_distribute_dataset([x]))

    @kd.function
    def step(data):
        doubled = strategy.run(lambda v: v * 2.0, args=(data,))
        summed = strategy.extended.reduce_to("SUM", doubled, destinations=None)
        mean = strategy.extended.batch_reduce_to("MEAN", [(doubled, None)])[0]
        three = strategy.extended.broadcast_to(np.float32(3.0), None)
        plus = strategy.reduce("SUM", strategy.run(lambda a: a + 1.0, args=(three,)), None)
        return summed, mean, plus

    summed, mean, plus = step(batch)
    assert [np.asarray(c).tolist() for c in strategy.experimental_local_results(summed)] == [
        [[24.0, 32.0]]
    ] * 4
    np.testing.assert_allclose(strategy.experimental_local_results(mean)[0], [[6.0, 8.0]])
    assert float(plus) == 16.0


def test_local_results_and_values_from_function_inside_a_function():
    strategy = kd.MirroredStrategy(cpus(4))
    (batch,) = list(strategy.experimental_distribute_dataset([np.arange(8.0, dtype="float32")]))

    @kd.function
    def step(x):
        doubled = strategy.run(lambda v: v * 2.0, args=(x,))
        summed = strategy.extended.reduce_to("SUM", doubled, destinations=None)
        ids = strategy.experimental_distribute_values_from_function(
            lambda ctx: {"id": jnp.float32(ctx.replica_id_in_sync_group)}
        )
        return (
            strategy.experimental_local_results(summed)[0],
            [jnp.sum(c) for c in strategy.experimental_local_results(doubled)],
            strategy.reduce("SUM", ids["id"], axis=None),
        )

    summed, per_replica_sums, id_sum = step(batch)
    np.testing.assert_allclose(summed, [24.0, 32.0])  # rows 2i, 2i+1 doubled, summed
    assert [float(v) for v in per_replica_sums] == [2.0, 10.0, 18.0, 26.0]
    assert float(id_sum) == 6.0


def test_results_of_full_and_partial_batches_add_up_as_in_tfs_tutorial():
    # TF's custom-training tutorial: `total_loss += distributed_train_step(x)` over an
    # epoch whose last batch is partial (compiled program, then the step run as Python).
    # A compiled result lived on all 4 devices and the partial one on the first, and JAX
    # refused to add them; TF gives 120 + 70 = 190.
    strategy = kd.MirroredStrategy(cpus(4))
    x = np.arange(20, dtype="float32").reshape(10, 2)

    def summed(batch):
        return strategy.reduce(
            "SUM", strategy.run(lambda v: keras.ops.sum(v), args=(batch,)), axis=None
        )

    step = kd.function(summed)
    total = 0.0
    for batch in strategy.experimental_distribute_dataset([x[:8], x[8:]]):
        total += step(batch)
    assert float(total) == 190.0

    # Eager and compiled results mix, and either can be an argument of a compiled step.
    full, partial = strategy.experimental_distribute_dataset([x[:8], x[8:]])
    results = [summed(full), summed(partial), step(full), step(partial)]
    assert float(sum(results[1:], results[0])) == 380.0

    @kd.function
    def adds_to(carried, batch):
        return carried + summed(batch)

    assert [float(adds_to(r, full)) for r in results] == [240.0, 190.0, 240.0, 190.0]


@_EACH_STRATEGY
def test_an_argument_the_function_never_reads_is_accepted(make_strategy):
    # TF's input guide: a step over (features, labels) batches that uses only the features.
    strategy = make_strategy() or kd.get_strategy()
    x = np.arange(32, dtype="float32").reshape(16, 2)
    dataset = strategy.experimental_distribute_dataset(
        strategy.experimental_make_numpy_dataset((x, x[:, :1])).batch(8)
    )

    @kd.function
    def step(batch):
        per_replica = strategy.run(lambda inputs: 2 * inputs[0], args=(batch,))
        return strategy.reduce("SUM", per_replica, axis=0)

    sums = [np.asarray(step(batch)) for batch in dataset]
    np.testing.assert_array_equal(sums, [2 * x[:8].sum(0), 2 * x[8:].sum(0)])

    @kd.function
    def first(a, unused):
        return a * 2

    one = np.ones(3, "float32")
    doubled = first(jax.device_put(one), jax.device_put(one))
    np.testing.assert_array_equal(np.asarray(doubled), 2 * one)


class _Doubler:
    @kd.function
    def double(self, x):
        return x * 2


def _halve(x):
    return x / 2


def test_a_function_and_a_method_pickle_as_their_python():
    # A parameter-server coordinator ships what it schedules; programs stay behind.
    import pickle

    halve = kd.function(_halve)
    halve(jnp.ones(2))  # a program built: it is not what is pickled
    assert float(pickle.loads(pickle.dumps(halve))(4.0)) == 2.0
    doubler = _Doubler()
    assert float(pickle.loads(pickle.dumps(doubler.double))(3.0)) == 6.0


@_EACH_STRATEGY
def test_a_returned_variable_gives_its_value_as_the_function_left_it(make_strategy):
    # The usual way to log the step or the loss scale from the step. Before, a compiled
    # function returned the variable's value from when it was traced, on every call.
    strategy = make_strategy() or kd.get_strategy()
    with strategy.scope():
        model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
        optimizer = keras.optimizers.SGD(0.1)
        calls = keras.Variable(0.0)

    def replica_fn(x):
        loss, grads = kd.value_and_grad(
            lambda: keras.ops.mean(model(x) ** 2), model.trainable_variables
        )()
        optimizer.apply(grads, model.trainable_variables)
        return loss

    @kd.function
    def step(x):
        strategy.run(replica_fn, args=(x,))
        calls.assign_add(1.0)
        return {"iterations": optimizer.iterations, "calls": calls, "bias": model.layers[0].bias}

    x = np.ones((8, 3), "float32")
    for call in (1, 2, 3):
        returned = step(x)
        assert int(np.asarray(returned["iterations"])) == call
        assert float(np.asarray(returned["calls"])) == float(call)
        np.testing.assert_array_equal(
            np.asarray(returned["bias"]), np.asarray(model.layers[0].bias)
        )


@pytest.mark.parametrize("as_function", [True, False], ids=["kd_function", "strategy_run"])
@pytest.mark.parametrize(
    "make_strategy",
    [lambda: kd.MirroredStrategy(cpus(1)), lambda: kd.OneDeviceStrategy("/cpu:0")],
    ids=["mirrored_one_device", "one_device"],
)
def test_one_device_steps_place_nothing_anew_after_the_first(
    monkeypatch, make_strategy, as_function
):
    # On one device the optimizer's learning rate (never written by the step) and
    # the distributed batches are arrays of that device, where the program takes a
    # one-device mesh's: the same place under another name. Placing them again
    # each step cost a transfer and every variable's read: half the step's speed.
    strategy = make_strategy()
    model, optimizer, accuracy = _build(strategy)
    step = _tutorial_step(strategy, model, optimizer, accuracy)
    step = kd.function(step) if as_function else step
    batches = list(strategy.experimental_distribute_dataset(_data()[:4]))
    losses = [float(step(batch)) for batch in batches[:2]]

    placed = []
    real_device_put = jax.device_put
    monkeypatch.setattr(
        jax, "device_put", lambda *a, **k: placed.append(a) or real_device_put(*a, **k)
    )
    losses += [float(step(batch)) for batch in batches[2:]]
    monkeypatch.undo()
    assert placed == []

    reference, ref_optimizer, _ = _build(None)
    expected = _train_plain(reference, ref_optimizer, _data()[:4])
    np.testing.assert_allclose(losses, expected, rtol=1e-5)
    for got, want in zip(model.get_weights(), reference.get_weights()):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def _train_plain(model, optimizer, batches):
    """The tutorial's step on one device with plain Keras and JAX: the losses to match."""
    losses = []
    for images, labels in batches:

        def loss_fn(trainable):
            logits, _ = model.stateless_call(
                trainable, [v.value for v in model.non_trainable_variables], images, training=True
            )
            return jnp.sum(_LOSS(labels, logits)) / GLOBAL_BATCH

        trainable = [v.value for v in model.trainable_variables]
        loss, grads = jax.value_and_grad(loss_fn)(trainable)
        optimizer.apply(grads, model.trainable_variables)
        losses.append(float(loss))
    return losses


@pytest.mark.parametrize(
    "make_strategy, inside",
    [
        (lambda: None, False),
        (lambda: kd.MirroredStrategy(cpus(4)), False),
        (lambda: kd.MirroredStrategy(cpus(4)), True),
        (lambda: kd.OneDeviceStrategy("/cpu:0"), False),
    ],
    ids=["default", "mirrored_outside_scope", "mirrored", "one_device_outside_scope"],
)
@pytest.mark.parametrize("as_function", [True, False], ids=["kd_function", "strategy_run"])
def test_a_variable_read_only_by_the_loss_is_read_on_every_call(make_strategy, inside, as_function):
    # A variable the loss of `value_and_grad` reads (a frozen layer's weight, a scale
    # set between steps) but does not differentiate was a constant of the first trace:
    # `set_weights` or `assign` between steps was ignored, silently.
    strategy = make_strategy()
    with strategy.scope() if inside else contextlib.nullcontext():
        scale = keras.Variable(1.0, trainable=False)
    with strategy.scope() if strategy else contextlib.nullcontext():
        w = keras.Variable(1.0)
    strategy = strategy or kd.get_strategy()

    def replica_fn(x):
        loss, (grad,) = kd.value_and_grad(lambda: keras.ops.sum(x) * w * scale, [w])()
        w.assign_sub(0.0 * grad)
        return loss

    def step(x):
        return strategy.reduce("SUM", strategy.run(replica_fn, args=(x,)), axis=None)

    step = kd.function(step) if as_function else step
    batches = iter(strategy.experimental_distribute_dataset([np.ones(4, "float32")] * 3))
    losses = []
    for value in (1.0, 2.0, 3.0):
        scale.assign(value)
        losses.append(float(step(next(batches))))
    assert losses == [4.0, 8.0, 12.0]


@pytest.mark.parametrize(
    "make_strategy",
    [lambda: kd.OneDeviceStrategy("/cpu:0"), lambda: kd.MirroredStrategy(cpus(1))],
    ids=["one_device", "mirrored_one_device"],
)
@pytest.mark.parametrize("as_function", [True, False], ids=["kd_function", "strategy_run"])
def test_a_variables_own_array_as_the_argument_of_a_step_that_writes_it(make_strategy, as_function):
    # On one device the variable, placed for the program, is the same buffer as the
    # argument: donated twice, XLA refused ("a buffer that was previously donated").
    strategy = make_strategy()
    with strategy.scope():
        w = keras.Variable(np.ones(3, "float32"))

    def replica_fn(x):
        w.assign(w * 2.0 + x)
        return w.value + 0.0

    def step(x):
        return strategy.run(replica_fn, args=(x,))

    step = kd.function(step) if as_function else step
    results = [np.asarray(step(w.value)).tolist() for _ in range(2)]
    assert results == [[3.0] * 3, [9.0] * 3]
    np.testing.assert_array_equal(w.numpy(), [9.0] * 3)


@pytest.mark.parametrize("replicas", [4, 1])
def test_a_step_counter_made_outside_the_scope_counts_in_a_function(replicas):
    # TF's step counter: a plain variable made before the strategy, incremented in the
    # step. Its first trace placed it on one device and fixed that in the program
    # ("incompatible devices" under 4 replicas).
    strategy = kd.MirroredStrategy(cpus(replicas))
    steps = keras.Variable(0, dtype="int32")
    with strategy.scope():
        w = keras.Variable(2.0)

    @kd.function
    def step():
        steps.assign_add(1)
        return strategy.reduce("SUM", strategy.run(lambda: w * 1.0), axis=None)

    assert [float(step()) for _ in range(3)] == [2.0 * replicas] * 3
    assert int(steps.value) == 3
    assert step.experimental_get_tracing_count() == 1


def test_new_values_from_a_function_each_call_compile_once():
    # TF compiles once for values of one spec; each new value from
    # experimental_distribute_values_from_function ran as Python here (traced 0 times).
    strategy = kd.MirroredStrategy(cpus(4))

    @kd.function
    def doubled(value):
        return strategy.run(lambda x: x * 2.0, args=(value,))

    for call in range(3):
        value = strategy.experimental_distribute_values_from_function(
            lambda context, call=call: np.float32(context.replica_id_in_sync_group + call)
        )
        result = strategy.experimental_local_results(doubled(value))
        assert [float(x) for x in result] == [2.0 * (i + call) for i in range(4)]
    assert doubled.experimental_get_tracing_count() == 1
    # Components of different shapes (uneven) still run, as Python.
    uneven = strategy.experimental_distribute_values_from_function(
        lambda context: np.ones((context.replica_id_in_sync_group + 1,), "float32")
    )
    shapes = [x.shape for x in strategy.experimental_local_results(doubled(uneven))]
    assert shapes == [(1,), (2,), (3,), (4,)]
