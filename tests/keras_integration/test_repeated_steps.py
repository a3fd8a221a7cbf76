"""``fit``'s steps on a batch layout that ran before call its kept program directly.

The first batch of a layout goes through ``strategy.run``; later ones skip its
splitting and key building (``_keras_steps/_repeated_steps.py``). These tests
check that the shortcut is taken, that its numbers are one device's, and that
whatever would change the program (new variables, eager execution) sends the
step back through ``strategy.run``.
"""

import keras
import numpy as np
import pytest
from conftest import cpus

import keras_dist as kd
from keras_dist._engine import MISSED
from keras_dist._keras_steps._repeated_steps import RepeatedSteps


def _data(rows=300):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(rows, 6)).astype("float32")
    y = (x @ rng.normal(size=(6, 1))).astype("float32")
    return x, y


def _model():
    keras.utils.set_random_seed(3)
    model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(16), keras.layers.Dense(1)])
    model.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse", metrics=["mae"])
    return model


class _Count:
    """Counts ``strategy.run`` calls and the kept programs' runs (hits) and misses."""

    def __init__(self, strategy, monkeypatch):
        self.runs = 0
        self.hits = 0
        self.misses = 0
        original_run = strategy.run

        def run(fn, args=(), kwargs=None, options=None):
            self.runs += 1
            return original_run(fn, args, kwargs, options)

        strategy.run = run
        original_repeat = RepeatedSteps.run

        def repeat(steps, name, data, **kwargs):
            had_call = steps._calls.get(steps._layout(name, data)[1]) is not None
            result = original_repeat(steps, name, data, **kwargs)
            self.hits += result is not MISSED
            self.misses += had_call and result is MISSED
            return result

        monkeypatch.setattr(RepeatedSteps, "run", repeat)


def _counted_model(replicas, monkeypatch):
    """``(strategy, count, model)``: ``_model()`` under a Mirrored strategy, its calls counted."""
    strategy = kd.MirroredStrategy(cpus(replicas))
    count = _Count(strategy, monkeypatch)
    with strategy.scope():
        model = _model()
    return strategy, count, model


@pytest.mark.parametrize("replicas", [1, 4])
def test_later_batches_of_a_layout_skip_strategy_run_and_give_one_devices_numbers(
    replicas, monkeypatch
):
    x, y = _data()
    expected_model = _model()
    expected = expected_model.fit(x, y, batch_size=32, epochs=3, shuffle=False, verbose=0)
    expected_eval = expected_model.evaluate(x, y, batch_size=32, verbose=0)

    strategy, count, model = _counted_model(replicas, monkeypatch)
    history = model.fit(x, y, batch_size=32, epochs=3, shuffle=False, verbose=0)
    evaluation = model.evaluate(x, y, batch_size=32, verbose=0)

    # 9 batches of 32 rows and one of 12 per epoch. Through `strategy.run`: the
    # first full batch of fit and of evaluate, and the 12-row batch on 1 replica
    # (its own layout, learned once) or on 4 (3 rows each; 12 / 4 is even) once;
    # every other full batch runs its kept program.
    assert count.runs == 4
    assert count.hits == 3 * 10 + 10 - count.runs
    assert count.misses == 0
    for key in ("loss", "mae"):
        np.testing.assert_allclose(history.history[key], expected.history[key], rtol=1e-5)
    np.testing.assert_allclose(evaluation, expected_eval, rtol=1e-5)
    for got, want in zip(model.get_weights(), expected_model.get_weights()):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("replicas", [1, 4])
def test_predict_runs_the_kept_program_for_every_batch_after_the_first(replicas, monkeypatch):
    x, _ = _data()
    expected = _model().predict(x, batch_size=32, verbose=0)

    strategy, count, model = _counted_model(replicas, monkeypatch)
    predictions = model.predict(x, batch_size=32, verbose=0)
    again = model.predict(x[:100], batch_size=32, verbose=0)

    # 9 batches of 32 and one of 12, padded to 32 (one layout): the first goes
    # through `strategy.run`, every later one, the next predict's too, runs its program.
    assert count.runs == 1
    assert count.hits == 9 + 4
    assert predictions.shape == (300, 1) and again.shape == (100, 1)
    np.testing.assert_allclose(predictions, expected, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(again, expected[:100], rtol=1e-5, atol=1e-6)


def test_predict_of_a_two_output_model_through_the_kept_program(monkeypatch):
    x, _ = _data(rows=100)

    def two_outputs():
        keras.utils.set_random_seed(3)
        inputs = keras.Input((6,))
        hidden = keras.layers.Dense(8, activation="relu")(inputs)
        outputs = {"a": keras.layers.Dense(1)(hidden), "b": keras.layers.Dense(3)(hidden)}
        return keras.Model(inputs, outputs)

    expected = two_outputs().predict(x, batch_size=16, verbose=0)
    strategy = kd.MirroredStrategy(cpus(4))
    count = _Count(strategy, monkeypatch)
    with strategy.scope():
        model = two_outputs()
    predictions = model.predict(x, batch_size=16, verbose=0)

    assert count.runs == 1 and count.hits == 6  # 6 batches of 16 and one of 4, padded
    assert set(predictions) == {"a", "b"}
    for name in ("a", "b"):
        np.testing.assert_allclose(predictions[name], expected[name], rtol=1e-5, atol=1e-6)


def test_a_partial_batch_that_splits_unevenly_never_uses_a_kept_program(monkeypatch):
    x, y = _data(rows=298)  # the last batch has 10 rows: 3, 3, 2, 2 on 4 replicas
    expected_model = _model()
    expected = expected_model.fit(x, y, batch_size=32, epochs=2, shuffle=False, verbose=0)

    strategy, count, model = _counted_model(4, monkeypatch)
    history = model.fit(x, y, batch_size=32, epochs=2, shuffle=False, verbose=0)

    assert count.hits == 2 * 9 - 1  # every full batch but the first
    np.testing.assert_allclose(history.history["loss"], expected.history["loss"], rtol=1e-5)
    for got, want in zip(model.get_weights(), expected_model.get_weights()):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


class _NewVariableAfterFirstEpoch(keras.callbacks.Callback):
    """Creates a variable in the strategy's scope: its program must thread it."""

    def __init__(self, strategy):
        super().__init__()
        self.strategy = strategy
        self.created = None

    def on_epoch_end(self, epoch, logs=None):
        if epoch == 0:
            with self.strategy.scope():
                self.created = keras.Variable(np.ones(3, "float32"), name="late")


def test_a_variable_created_during_fit_sends_the_next_step_through_strategy_run(monkeypatch):
    x, y = _data()
    expected_model = _model()
    expected = expected_model.fit(x, y, batch_size=30, epochs=2, shuffle=False, verbose=0)

    strategy, count, model = _counted_model(2, monkeypatch)
    late = _NewVariableAfterFirstEpoch(strategy)
    history = model.fit(x, y, batch_size=30, epochs=2, shuffle=False, verbose=0, callbacks=[late])

    assert count.misses == 1  # the kept program no longer threads every variable
    assert count.runs == 2  # the first batch of each epoch
    np.testing.assert_allclose(history.history["loss"], expected.history["loss"], rtol=1e-5)
    np.testing.assert_allclose(np.asarray(late.created.value), np.ones(3))


class _CountsEagerSteps(keras.Sequential):
    """Counts its ``train_step``'s Python calls: once per trace, or once per replica and
    step when it runs eagerly."""

    calls = 0

    def train_step(self, state, data):
        type(self).calls += 1
        return super().train_step(state, data)


def _counting_model():
    keras.utils.set_random_seed(3)
    model = _CountsEagerSteps([keras.Input((6,)), keras.layers.Dense(1)])
    model.compile(optimizer="sgd", loss="mse")
    return model


@pytest.mark.parametrize("switch", ["model.run_eagerly", "kd.config.run_functions_eagerly"])
def test_running_eagerly_after_a_compiled_fit_is_not_skipped(switch):
    x, y = _data(rows=128)
    strategy = kd.MirroredStrategy(cpus(2))
    with strategy.scope():
        model = _counting_model()
    model.fit(x, y, batch_size=32, epochs=1, verbose=0)  # compiled: kept programs
    before = _CountsEagerSteps.calls
    if switch == "model.run_eagerly":
        model.run_eagerly = True
    else:
        kd.config.run_functions_eagerly(True)
    try:
        model.fit(x, y, batch_size=32, epochs=1, verbose=0)
    finally:
        kd.config.run_functions_eagerly(False)
    assert _CountsEagerSteps.calls - before == 4 * 2  # 4 steps on 2 replicas, all eager
