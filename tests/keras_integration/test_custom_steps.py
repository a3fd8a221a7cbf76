"""Custom JAX ``train_step``/``test_step`` (Keras's "Customizing fit() with JAX" guide) under
a strategy give one device's numbers: gradients, metrics, History and ``evaluate``."""

import jax
import keras
import numpy as np
import pytest
from conftest import cpus

import keras_dist as kd


class GuideModel(keras.Model):
    """The guide's first example: compiled loss and metrics, state in and out."""

    def compute_loss_and_updates(self, trainable, non_trainable, metrics, x, y, training):
        y_pred, non_trainable = self.stateless_call(trainable, non_trainable, x, training=training)
        loss, (trainable, non_trainable, metrics) = self.stateless_compute_loss(
            trainable, non_trainable, metrics, x=x, y=y, y_pred=y_pred, training=training
        )
        return loss, (y_pred, non_trainable, metrics)

    def _metrics_and_logs(self, metrics_values, loss, y, y_pred):
        new_values, logs = [], {}
        for metric in self.metrics:
            values = metrics_values[len(new_values) : len(new_values) + len(metric.variables)]
            if metric.name == "loss":
                values = metric.stateless_update_state(values, loss)
            else:
                values = metric.stateless_update_state(values, y, y_pred)
            logs[metric.name] = metric.stateless_result(values)
            new_values += values
        return new_values, logs

    def train_step(self, state, data):
        trainable, non_trainable, optimizer_values, metrics = state
        x, y = data
        grad_fn = jax.value_and_grad(self.compute_loss_and_updates, has_aux=True)
        (loss, (y_pred, non_trainable, metrics)), grads = grad_fn(
            trainable, non_trainable, metrics, x, y, True
        )
        trainable, optimizer_values = self.optimizer.stateless_apply(
            optimizer_values, grads, trainable
        )
        metrics, logs = self._metrics_and_logs(metrics, loss, y, y_pred)
        return logs, (trainable, non_trainable, optimizer_values, metrics)

    def test_step(self, state, data):
        trainable, non_trainable, metrics = state
        x, y = data
        loss, (y_pred, non_trainable, metrics) = self.compute_loss_and_updates(
            trainable, non_trainable, metrics, x, y, False
        )
        metrics, logs = self._metrics_and_logs(metrics, loss, y, y_pred)
        return logs, (trainable, non_trainable, metrics)


class TrackerModel(keras.Model):
    """The guide's lower-level example: its own loss function and ``Mean`` tracker."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.loss_tracker = keras.metrics.Mean(name="loss")
        self.mae_metric = keras.metrics.MeanAbsoluteError(name="mae")
        self.loss_fn = keras.losses.MeanSquaredError()

    def compute_loss_and_updates(self, trainable, non_trainable, x, y, training):
        y_pred, non_trainable = self.stateless_call(trainable, non_trainable, x, training=training)
        return self.loss_fn(y, y_pred), (y_pred, non_trainable)

    def train_step(self, state, data):
        trainable, non_trainable, optimizer_values, metrics = state
        x, y = data
        grad_fn = jax.value_and_grad(self.compute_loss_and_updates, has_aux=True)
        (loss, (y_pred, non_trainable)), grads = grad_fn(trainable, non_trainable, x, y, True)
        trainable, optimizer_values = self.optimizer.stateless_apply(
            optimizer_values, grads, trainable
        )
        loss_values = self.loss_tracker.stateless_update_state(metrics[:2], loss)
        mae_values = self.mae_metric.stateless_update_state(metrics[2:], y, y_pred)
        logs = {
            "loss": self.loss_tracker.stateless_result(loss_values),
            "mae": self.mae_metric.stateless_result(mae_values),
        }
        return logs, (trainable, non_trainable, optimizer_values, loss_values + mae_values)

    @property
    def metrics(self):
        return [self.loss_tracker, self.mae_metric]


def _build(cls, strategy):
    keras.utils.set_random_seed(3)
    with strategy.scope() if strategy else keras.name_scope("plain"):
        inputs = keras.Input((5,))
        hidden = keras.layers.Dense(8, activation="relu")(inputs)
        model = cls(inputs, keras.layers.Dense(1)(hidden))
        optimizer = keras.optimizers.SGD(0.05, momentum=0.9)
        model.compile(optimizer=optimizer, loss="mse", metrics=["mae"])
    return model


def _data(rows):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(rows, 5)).astype("float32")
    return x, (x @ rng.normal(size=(5, 1))).astype("float32")


def _fit_as_one_device(cls, rows, epochs):
    """``cls`` fitted on 4 replicas and on one device from the same start: the weights
    must agree; returns the two Histories' dicts."""
    x, y = _data(rows)
    ours, plain = _build(cls, kd.MirroredStrategy(cpus(4))), _build(cls, None)
    histories = [
        m.fit(x, y, batch_size=16, epochs=epochs, shuffle=False, verbose=0).history
        for m in (ours, plain)
    ]
    for a, b in zip(ours.get_weights(), plain.get_weights()):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    return histories


@pytest.mark.parametrize("cls", [GuideModel, TrackerModel], ids=["compiled_loss", "own_tracker"])
def test_a_custom_jax_train_step_trains_and_reports_as_one_device(cls):
    histories = _fit_as_one_device(cls, rows=64, epochs=3)
    assert set(histories[0]) == set(histories[1]) == {"loss", "mae"}
    for key in histories[1]:
        np.testing.assert_allclose(histories[0][key], histories[1][key], rtol=1e-5)
    assert histories[1]["loss"][-1] < histories[1]["loss"][0]  # it did train


def test_a_custom_jax_test_step_evaluates_as_one_device():
    x, y = _data(64)
    ours, plain = _build(GuideModel, kd.MirroredStrategy(cpus(4))), _build(GuideModel, None)
    results = [m.evaluate(x, y, batch_size=16, return_dict=True, verbose=0) for m in (ours, plain)]
    assert set(results[0]) == {"loss", "mae"}
    for key in results[1]:
        np.testing.assert_allclose(results[0][key], results[1][key], rtol=1e-5)


def test_a_custom_train_step_with_a_partial_last_batch_updates_as_one_device():
    # 50 rows in batches of 16: the last batch's 2 rows go to two of the four replicas,
    # each counting as 1/2 of that batch's gradient.
    histories = _fit_as_one_device(GuideModel, rows=50, epochs=2)
    # A metric of rows (MAE) sums every replica's rows. (The loss tracker is a mean of
    # each step's loss: every replica adds its own, so a step whose rows are spread
    # unevenly is weighted differently than on one device, as under TF.)
    np.testing.assert_allclose(histories[0]["mae"], histories[1]["mae"], rtol=1e-5)


class SuperModel(keras.Model):
    """A custom step that adds to Keras's own (which scales its loss itself)."""

    def train_step(self, state, data):
        logs, state = super().train_step(state, data)
        return {**logs, "twice_loss": 2 * logs["loss"]}, state


def test_a_custom_step_calling_keras_own_counts_the_gradients_once():
    histories = _fit_as_one_device(SuperModel, rows=64, epochs=2)
    for key in ("loss", "mae", "twice_loss"):
        np.testing.assert_allclose(histories[0][key], histories[1][key], rtol=1e-5)
