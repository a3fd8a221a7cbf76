"""``steps_per_execution`` runs several fit steps in one compiled call, as one device would.

The call is one loop over the steps (``_fused_steps``), except for a model with
convolutions on CPU, whose steps run one call each; both forms run here.
"""

import jax
import keras
import numpy as np
import pytest
from conftest import cpus

import keras_dist as kd
from keras_dist._engine import MISSED
from keras_dist._keras_steps import _steps
from keras_dist._keras_steps._repeated_steps import RepeatedSteps


def _fit(strategy, steps_per_execution, rows=300, epochs=2):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(rows, 5)).astype("float32")
    y = (x[:, 0] * 2 - x[:, 1]).astype("float32")[:, None]
    keras.utils.set_random_seed(4)
    with strategy.scope():
        model = keras.Sequential([keras.Input((5,)), keras.layers.Dense(8), keras.layers.Dense(1)])
        model.compile(
            optimizer=keras.optimizers.Adam(0.01),
            loss="mse",
            metrics=["mae"],
            steps_per_execution=steps_per_execution,
        )
    history = model.fit(x, y, batch_size=32, epochs=epochs, shuffle=False, verbose=0)
    evaluation = model.evaluate(x, y, batch_size=32, verbose=0)
    return model, history.history, evaluation


@pytest.fixture(params=["loop", "apart"])
def fused_as(request, monkeypatch):
    """The form of an execution's steps: one loop, or one call each (convolutions on CPU)."""
    monkeypatch.setattr(_steps, "steps_fuse", lambda devices, model, data: request.param == "loop")
    return request.param


@pytest.mark.parametrize("steps_per_execution", [3, 4])
def test_fused_steps_equal_one_device(steps_per_execution, fused_as, monkeypatch):
    reference, reference_history, reference_eval = _fit(kd.OneDeviceStrategy("/cpu:0"), 1)
    strategy = kd.MirroredStrategy(cpus(4))
    calls = []
    original_run = strategy.run

    def counting_run(fn, args=(), kwargs=None, options=None):
        calls.append(fn)
        return original_run(fn, args, kwargs, options)

    strategy.run = counting_run
    # A batch of a layout that ran before calls its kept program, not `strategy.run`.
    original_repeat = RepeatedSteps.run

    def counting_repeat(self, name, data, **kwargs):
        result = original_repeat(self, name, data, **kwargs)
        if result is not MISSED:
            calls.append(name)
        return result

    monkeypatch.setattr(RepeatedSteps, "run", counting_repeat)
    model, history, evaluation = _fit(strategy, steps_per_execution)
    assert int(model.optimizer.iterations.value) == 2 * 10  # 9 full batches + 1 of 12 rows
    for got, want in zip(model.get_weights(), reference.get_weights()):
        np.testing.assert_allclose(got, want, atol=1e-5)
    for key in ("loss", "mae"):
        np.testing.assert_allclose(history[key], reference_history[key], atol=1e-5)
    np.testing.assert_allclose(evaluation, reference_eval, atol=1e-5)
    # 9 batches of 32 rows and one of 12 (3 per replica) per epoch, grouped by
    # `steps_per_execution`: 3 gives [1-3] [4-6] [7-9] [10]; 4 gives [1-4] [5-8]
    # [9, 10], whose batches differ in shape and run one by one. Two epochs of fit
    # and one evaluate: 4 calls each, against 10 without fusing.
    assert len(calls) == (12 if fused_as == "loop" else 30)


def test_a_loop_of_fused_steps_traces_the_step_once():
    # Unrolled, the program would hold a copy of the step per batch: compiling
    # steps_per_execution=50 would take 50 steps' compile. The loop holds one.
    strategy = kd.MirroredStrategy(cpus(2))
    traced = {"train": 0, "test": 0}
    with strategy.scope():
        model = keras.Sequential([keras.Input((5,)), keras.layers.Dense(3)])
        model.compile("sgd", "mse", metrics=["mae"], steps_per_execution=8)

    def counted(kind):
        original = getattr(model, f"{kind}_step")

        def step(state, data):
            traced[kind] += 1
            return original(state, data)

        return step

    model.train_step, model.test_step = counted("train"), counted("test")
    x, y = np.ones((64, 5), "float32"), np.ones((64, 3), "float32")
    model.fit(x, y, batch_size=8, epochs=2, verbose=0)
    model.evaluate(x, y, batch_size=8, verbose=0)
    # One program of 8 steps each (64 rows in batches of 8), traced once.
    assert traced == {"train": 1, "test": 1}
    assert int(model.optimizer.iterations.value) == 16


class _Filter(keras.layers.Layer):
    """A convolution by ``ops.conv`` in a layer whose name does not say so."""

    def build(self, input_shape):
        self.kernel = self.add_weight(shape=(3, input_shape[-1], 2))

    def call(self, x):
        return keras.ops.conv(x, self.kernel)


def test_steps_fuse_off_cpu_and_on_cpu_without_convolutions():
    cpu = jax.devices("cpu")

    class _Gpu:
        platform = "gpu"

    dense = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
    conv = keras.Sequential(
        [keras.Input((8, 8, 1)), keras.layers.Conv2D(2, 3), keras.layers.Flatten()]
    )

    class Nested(keras.Model):  # a convolution inside a layer of a subclassed model
        def __init__(self):
            super().__init__()
            self.block = keras.Sequential([keras.layers.SeparableConv1D(2, 3)])

        def call(self, x):
            return self.block(x)

    nested = Nested()
    nested(np.zeros((1, 8, 3), "float32"))  # (built by a call)
    filtered = keras.Sequential([keras.Input((8, 3)), _Filter(), keras.layers.Flatten()])
    images, sequences = np.zeros((4, 8, 8, 1), "float32"), np.zeros((4, 8, 3), "float32")
    assert _steps.steps_fuse(cpu, dense, (np.zeros((4, 4), "float32"), np.zeros(4)))
    assert not _steps.steps_fuse(cpu, conv, (images, np.zeros(4)))
    assert not _steps.steps_fuse(cpu, nested, (sequences,))
    assert not _steps.steps_fuse(cpu, filtered, (sequences, np.zeros(4)))
    assert _steps.steps_fuse([_Gpu()], conv, (images,))


def test_steps_fuse_by_layer_classes_when_the_forward_program_cannot_be_traced():
    """A custom ``train_step`` may take batches the model's ``call`` cannot (a dict here):
    then the layers' classes say whether there are convolutions."""
    cpu = jax.devices("cpu")
    conv = keras.Sequential([keras.Input((8, 8, 1)), keras.layers.Conv2D(2, 3)])
    filtered = keras.Sequential([keras.Input((8, 3)), _Filter()])
    batch = {"image": np.zeros((4, 8, 8, 1), "float32"), "label": np.zeros(4)}
    assert not _steps.steps_fuse(cpu, conv, batch)
    assert _steps.steps_fuse(cpu, filtered, batch)  # (its convolution is not seen)


def _fit_stateful(steps_per_execution):
    """A model whose step moves every kind of state: batch-norm statistics, dropout's
    seed, a dynamic loss scale (mixed float16), metrics."""
    keras.config.set_dtype_policy("mixed_float16")
    try:
        keras.utils.set_random_seed(1)
        with kd.MirroredStrategy(cpus(2)).scope():
            model = keras.Sequential(
                [
                    keras.Input((6,)),
                    keras.layers.Dense(8),
                    keras.layers.BatchNormalization(),
                    keras.layers.Dropout(0.3, seed=2),
                    keras.layers.Dense(1, dtype="float32"),
                ]
            )
            model.compile(
                keras.optimizers.LossScaleOptimizer(keras.optimizers.Adam(0.01)),
                "mse",
                metrics=["mae"],
                steps_per_execution=steps_per_execution,
            )
        rng = np.random.default_rng(3)
        x = rng.normal(size=(128, 6)).astype("float32")
        y = x.sum(axis=1, keepdims=True)
        history = model.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0).history
        return model, history, model.evaluate(x, y, batch_size=16, verbose=0)
    finally:
        keras.config.set_dtype_policy("float32")


def test_a_loop_of_steps_carries_every_kind_of_state_as_single_steps_do():
    # Batch-norm statistics are each replica's own and dropout draws per replica, so
    # the reference is the same strategy one step a call, not one device.
    single, single_history, single_eval = _fit_stateful(1)
    looped, looped_history, looped_eval = _fit_stateful(4)
    # (A step whose scaled gradients overflow is skipped: both skip the same ones.)
    assert int(looped.optimizer.iterations.value) == int(single.optimizer.iterations.value)
    for got, want in zip(looped.get_weights(), single.get_weights()):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    for got, want in zip(looped.optimizer.variables, single.optimizer.variables):
        np.testing.assert_allclose(np.asarray(got.value), np.asarray(want.value), rtol=1e-5)
    for key in ("loss", "mae"):
        np.testing.assert_allclose(looped_history[key], single_history[key], rtol=1e-5)
    np.testing.assert_allclose(looped_eval, single_eval, rtol=1e-5)


class _Batches(keras.callbacks.Callback):
    def __init__(self):
        super().__init__()
        self.ends = []

    def on_train_batch_end(self, batch, logs=None):
        self.ends.append(batch)


def test_an_epoch_runs_its_steps_per_epoch_not_whole_executions():
    # tf-keras: steps_per_epoch=5 with steps_per_execution=2 runs executions of 2, 2 and
    # 1 steps each epoch (ending at batches 1, 3, 4). Keras 3 ran whole executions: 6 steps
    # in the first epoch, reading into the second epoch's data.
    rng = np.random.default_rng(0)
    x = rng.normal(size=(80, 5)).astype("float32")
    y = x.sum(axis=1, keepdims=True)

    def fit(strategy, steps_per_execution):
        keras.utils.set_random_seed(1)
        with strategy.scope():
            model = keras.Sequential([keras.Input((5,)), keras.layers.Dense(1)])
            model.compile(
                keras.optimizers.SGD(0.05), "mse", steps_per_execution=steps_per_execution
            )
        batches = _Batches()
        model.fit(
            x,
            y,
            batch_size=8,
            epochs=2,
            steps_per_epoch=5,
            shuffle=False,
            callbacks=[batches],
            verbose=0,
        )
        return model.get_weights(), batches.ends, int(model.optimizer.iterations)

    one_step_weights, _, _ = fit(kd.OneDeviceStrategy("/cpu:0"), 1)
    weights, ends, iterations = fit(kd.MirroredStrategy(cpus(2)), 2)
    assert ends == [1, 3, 4, 1, 3, 4]
    assert iterations == 10
    for got, expected in zip(weights, one_step_weights):
        np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6)
