"""``steps_per_execution`` runs several fit steps in one compiled call, as one device would."""

import keras
import numpy as np
import pytest
from conftest import cpus

import keras_dist as kd
from keras_dist._engine import MISSED
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


@pytest.mark.parametrize("steps_per_execution", [3, 4])
def test_fused_steps_equal_one_device(steps_per_execution, monkeypatch):
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
    assert len(calls) == 12
