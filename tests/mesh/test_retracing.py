"""No silent retracing: re-created closures hit the cache, and frequent retracing warns."""

import warnings

import keras
import numpy as np
import pytest
from conftest import cpus

import keras_dist as kd
from keras_dist._engine._retracing import RetracingWarning


def _traces(strategy):
    return strategy.extended._compiled.trace_count


def test_a_closure_recreated_on_every_call_is_traced_once():
    # TF's tutorials define step_fn inside train_step: a new closure every call.
    strategy = kd.MirroredStrategy(cpus(2))
    with strategy.scope():
        model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
        optimizer = keras.optimizers.SGD(0.1)
    x = np.ones((4, 3), "float32")

    def train_step(inputs):
        def step_fn(batch):
            def loss_fn():
                return kd.nn.compute_average_loss(model(batch)[:, 0] ** 2)

            loss, grads = kd.value_and_grad(loss_fn, model.trainable_variables)()
            optimizer.apply_gradients(zip(grads, model.trainable_variables))
            return loss

        losses = strategy.run(step_fn, args=(inputs,))
        return strategy.reduce("SUM", losses, axis=None)

    dataset = strategy.experimental_distribute_dataset([x] * 6)
    first = None
    with warnings.catch_warnings():
        warnings.simplefilter("error", RetracingWarning)
        for i, batch in enumerate(dataset):
            train_step(batch)
            if i == 1:
                first = _traces(strategy)
    assert _traces(strategy) == first  # steps 3..6 traced nothing
    assert int(optimizer.iterations) == 6


def test_closures_capturing_different_objects_are_different_functions():
    strategy = kd.MirroredStrategy(cpus(2))

    def make(scale):
        return lambda: scale * 1.0

    assert float(strategy.reduce("SUM", strategy.run(make(2.0)), axis=None)) == 4.0
    assert float(strategy.reduce("SUM", strategy.run(make(3.0)), axis=None)) == 6.0
    before = _traces(strategy)
    assert float(strategy.reduce("SUM", strategy.run(make(3.0)), axis=None)) == 6.0
    assert _traces(strategy) == before


def test_the_same_function_with_a_captured_object_replaced_runs_the_new_object():
    # A loop's step function is keyed once while it captures the same objects: one
    # whose closure cell now holds another layer or number is another function.
    strategy = kd.MirroredStrategy(cpus(2))
    with strategy.scope():
        first = keras.layers.Dense(1, kernel_initializer="ones", use_bias=False)
        second = keras.layers.Dense(1, kernel_initializer=keras.initializers.Constant(2.0))
    layer, scale = first, 1.0
    x = np.ones((4, 3), "float32")

    def replica_fn(inputs):
        return keras.ops.sum(layer(inputs)) * scale

    def total():
        return float(strategy.reduce("SUM", strategy.run(replica_fn, args=(x,)), axis=None))

    assert total() == 24.0  # each replica: 4 rows of 3 ones, times the kernel's 1s
    assert total() == 24.0
    layer = second
    assert total() == 48.0
    scale = 0.5
    assert total() == 24.0
    layer = first
    assert total() == 12.0


def test_a_closure_over_a_list_or_dict_made_afresh_is_traced_once():
    # A list or a dict is neither hashable nor weakly referenceable: the key is what
    # it holds, so a closure made every call over the same objects hits the cache.
    strategy = kd.MirroredStrategy(cpus(2))
    with strategy.scope():
        layers = [keras.layers.Dense(1), keras.layers.Dense(1)]
    settings = {"scale": 2.0}
    x = np.ones((4, 3), "float32")

    def step(batch):
        def replica_fn(inputs):
            return layers[1](layers[0](inputs)) * settings["scale"]

        return strategy.run(replica_fn, args=(batch,))

    step(x)
    before = _traces(strategy)
    for _ in range(3):
        step(x)
    assert _traces(strategy) == before
    settings["scale"] = 3.0  # what the closure holds changed: a new program
    step(x)
    assert _traces(strategy) == before + 1


@pytest.mark.parametrize(
    "call, cause",
    [
        (lambda s, i: s.run(lambda x: x * 2, args=(np.ones(i + 1),)), "new shapes or dtypes"),
        (lambda s, i: s.run(lambda x: x * 2, args=(float(i),)), "new Python values"),
    ],
    ids=["shapes", "python-values"],
)
def test_frequent_retracing_warns_with_its_cause(call, cause):
    strategy = kd.MirroredStrategy(cpus(2))
    with pytest.warns(RetracingWarning, match=f"5 of the last 5 calls.*{cause}"):
        for i in range(6):
            call(strategy, i)


def test_a_new_function_object_each_call_warns():
    strategy = kd.MirroredStrategy(cpus(2))
    values = []

    def fresh(i):
        captured = [i]  # a list: not comparable by value, so each closure is new
        return lambda: captured[0] * 1.0

    with pytest.warns(RetracingWarning, match="a new function object"):
        for i in range(6):
            values.append(float(strategy.reduce("SUM", strategy.run(fresh(i)), axis=None)))
    assert values == [0.0, 2.0, 4.0, 6.0, 8.0, 10.0]


@pytest.mark.parametrize("steps_per_execution", [1, 3])
def test_training_several_models_is_not_retracing(steps_per_execution):
    # Each model's steps are bound methods of their own object: a script (or a search)
    # that trains model after model traces each once, which is no reason to warn.
    # (40 rows in batches of 8: with steps_per_execution=3, executions of 3 and 2 steps.)
    strategy = kd.MirroredStrategy(cpus(4))
    x = np.random.default_rng(0).normal(size=(40, 4)).astype("float32")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(6):
            with strategy.scope():
                model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
                model.compile(optimizer="sgd", loss="mse", steps_per_execution=steps_per_execution)
            model.fit(x, x[:, :1], batch_size=8, epochs=2, verbose=0, validation_data=(x, x[:, :1]))
    assert not [w for w in caught if issubclass(w.category, RetracingWarning)]
