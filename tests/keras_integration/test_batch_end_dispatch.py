"""A strategy's loops skip Keras's batch-end dispatch only where no callback has a batch-end hook.

Keras hands every batch's end to a thread that copies the logs to the host and
calls each callback's hook, even when all of them are ``Callback``'s empty
defaults. Under a strategy that dispatch is skipped then; any callback with a
batch-end hook (the progress bar, a user's) still gets every batch's logs, with
one device's values.
"""

import keras
import numpy as np
import pytest
from conftest import cpus

import keras_dist as kd


def _data():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(256, 4)).astype("float32")
    return x, (x @ np.ones((4, 1), "float32")).astype("float32")


def _model():
    keras.utils.set_random_seed(5)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
    model.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse", metrics=["mae"])
    return model


class _Dispatches:
    """Counts the batch ends Keras's ``CallbackList`` hands to its thread, by loop."""

    def __init__(self, monkeypatch):
        self.counts = {"train": 0, "test": 0, "predict": 0}
        for kind in self.counts:
            name = f"_on_{kind}_batch_end"
            original = getattr(keras.callbacks.CallbackList, name)
            monkeypatch.setattr(keras.callbacks.CallbackList, name, self._counting(kind, original))

    def _counting(self, kind, original):
        def dispatched(callbacks, batch, logs=None):
            self.counts[kind] += 1
            return original(callbacks, batch, logs)

        return dispatched


class _TrainLogs(keras.callbacks.Callback):
    def __init__(self):
        super().__init__()
        self.losses = []

    def on_train_batch_end(self, batch, logs=None):
        self.losses.append(logs["loss"])


class _OnBatchEnd(keras.callbacks.Callback):
    """Overrides only the generic ``on_batch_end`` (the train hook's default calls it)."""

    def __init__(self):
        super().__init__()
        self.batches = []

    def on_batch_end(self, batch, logs=None):
        self.batches.append(batch)


class _TestAndPredictEnds(keras.callbacks.Callback):
    def __init__(self):
        super().__init__()
        self.test, self.predict = 0, 0

    def on_test_batch_end(self, batch, logs=None):
        self.test += 1

    def on_predict_batch_end(self, batch, logs=None):
        self.predict += 1


def _run_all(model, x, y, callbacks):
    model.fit(x, y, batch_size=32, epochs=2, verbose=0, shuffle=False, callbacks=callbacks)
    model.evaluate(x, y, batch_size=64, verbose=0, callbacks=callbacks)
    model.predict(x, batch_size=64, verbose=0, callbacks=callbacks)


def test_no_batch_end_hook_no_dispatch_under_a_strategy_and_keras_alone_unchanged(monkeypatch):
    x, y = _data()
    dispatches = _Dispatches(monkeypatch)
    with kd.MirroredStrategy(cpus(2)).scope():
        model = _model()
    _run_all(model, x, y, [keras.callbacks.EarlyStopping(monitor="loss")])
    assert dispatches.counts == {"train": 0, "test": 0, "predict": 0}

    _run_all(_model(), x, y, [keras.callbacks.EarlyStopping(monitor="loss")])  # no strategy
    assert dispatches.counts == {"train": 2 * 8, "test": 4, "predict": 4}


@pytest.mark.parametrize("replicas", [1, 2])
def test_a_batch_end_hook_gets_every_batch_with_one_devices_logs(replicas, monkeypatch):
    x, y = _data()
    expected = _TrainLogs()
    _model().fit(x, y, batch_size=32, epochs=2, verbose=0, shuffle=False, callbacks=[expected])

    dispatches = _Dispatches(monkeypatch)
    with kd.MirroredStrategy(cpus(replicas)).scope():
        model = _model()
    got, generic, other = _TrainLogs(), _OnBatchEnd(), _TestAndPredictEnds()
    _run_all(model, x, y, [got, generic, other])
    assert dispatches.counts == {"train": 2 * 8, "test": 4, "predict": 4}
    np.testing.assert_allclose(got.losses, expected.losses, rtol=1e-5)
    assert generic.batches == list(range(8)) * 2
    assert (other.test, other.predict) == (4, 4)


def test_the_progress_bar_still_gets_every_batch(capsys, monkeypatch):
    x, y = _data()
    dispatches = _Dispatches(monkeypatch)
    with kd.MirroredStrategy(cpus(2)).scope():
        model = _model()
    model.fit(x, y, batch_size=32, epochs=1, verbose=1, shuffle=False)
    assert dispatches.counts["train"] == 8
    printed = capsys.readouterr().out
    assert "8/8" in printed and "loss:" in printed
