"""Every Keras loss reduction under a strategy gives one device's numbers.

tf-keras's distribute test of loss reductions: 3 Dense layers with zero
initializers, SGD, ``MeanSquaredError(reduction=...)``, 2 steps of 32 rows.
Without a strategy the history loss of the ``"sum"`` reduction is 6.30027, and
TF 2.21's MirroredStrategy with Keras 3 gives the same on any replica count.
"""

import keras
import numpy as np
import pytest
from conftest import cpus

import keras_dist as kd

REDUCTIONS = ["sum", "sum_over_batch_size", "mean", "mean_with_sample_weight"]


def _data(rows=64):
    rng = np.random.RandomState(1337)
    x = rng.random_sample((rows, 10)).astype("float32")
    y = rng.random_sample((rows, 1)).astype("float32")
    weights = rng.random_sample((rows,)).astype("float32")
    return x, y, weights


def _model(reduction, steps_per_execution=1):
    inputs = keras.Input((10,))
    hidden = keras.layers.Dense(10, kernel_initializer="zeros")(inputs)
    hidden = keras.layers.Dense(10, kernel_initializer="zeros")(hidden)
    model = keras.Model(inputs, keras.layers.Dense(1, kernel_initializer="zeros")(hidden))
    model.compile(
        keras.optimizers.SGD(0.01),
        loss=keras.losses.MeanSquaredError(reduction=reduction),
        steps_per_execution=steps_per_execution,
    )
    return model


def _in_scope(strategy, build):
    if strategy is None:
        return build()
    with strategy.scope():
        return build()


def _fit(strategy, reduction, rows=64, sample_weight=False, steps_per_execution=1):
    x, y, weights = _data(rows)
    model = _in_scope(strategy, lambda: _model(reduction, steps_per_execution))
    history = model.fit(
        x,
        y,
        sample_weight=weights if sample_weight else None,
        batch_size=32,
        epochs=2,
        shuffle=False,
        verbose=0,
    )
    return history.history["loss"], model.get_weights()


def _assert_same(expected, actual):
    (expected_loss, expected_weights), (loss, weights) = expected, actual
    np.testing.assert_allclose(loss, expected_loss, rtol=1e-5)
    for want, got in zip(expected_weights, weights):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("replicas", [1, 2, 4])
def test_sum_reduction_fit_gives_tf_loss_on_any_replica_count(replicas):
    x, y, _ = _data()
    with kd.MirroredStrategy(cpus(replicas)).scope():
        model = _model("sum")
        model.compile("sgd", loss=keras.losses.MeanSquaredError(reduction="sum"))
    history = model.fit(x, y, batch_size=32, epochs=1, shuffle=False, verbose=0)
    np.testing.assert_allclose(history.history["loss"], [6.30027], rtol=1e-5)


@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("replicas", [2, 4])
def test_fit_equals_one_device_for_every_reduction(reduction, replicas):
    weighted = reduction == "mean_with_sample_weight"
    expected = _fit(None, reduction, sample_weight=weighted)
    actual = _fit(kd.MirroredStrategy(cpus(replicas)), reduction, sample_weight=weighted)
    _assert_same(expected, actual)


@pytest.mark.parametrize("reduction", ["sum", "sum_over_batch_size", "mean_with_sample_weight"])
def test_uneven_last_batch_equals_one_device(reduction):
    # 70 rows: batches of 32, 32 and 6 (6 rows split 2/2/1/1 over 4 replicas).
    expected = _fit(None, reduction, rows=70, sample_weight=True)
    actual = _fit(kd.MirroredStrategy(cpus(4)), reduction, rows=70, sample_weight=True)
    _assert_same(expected, actual)


def test_uneven_global_weighted_mean_in_a_custom_train_step_says_how_to_fix():
    # A model's own train_step runs an uneven batch on strategy.run's engines, whose
    # replicas cannot all-reduce the sample weights inside the gradient.
    class OwnStep(keras.Model):
        def train_step(self, state, data):
            return super().train_step(state, data)

    x, y, weights = _data(70)
    with kd.MirroredStrategy(cpus(4)).scope():
        inputs = keras.Input((10,))
        model = OwnStep(inputs, keras.layers.Dense(1)(inputs))
        model.compile("sgd", keras.losses.MeanSquaredError(reduction="mean_with_sample_weight"))
    with pytest.raises(ValueError, match="drop_remainder=True"):
        model.fit(x, y, sample_weight=weights, batch_size=32, shuffle=False, verbose=0)


@pytest.mark.parametrize("reduction", ["sum", "mean_with_sample_weight"])
def test_steps_per_execution_equals_one_device(reduction):
    expected = _fit(None, reduction, sample_weight=True, steps_per_execution=2)
    actual = _fit(
        kd.MirroredStrategy(cpus(2)), reduction, sample_weight=True, steps_per_execution=2
    )
    _assert_same(expected, actual)


def test_central_storage_sum_reduction_equals_one_device():
    expected = _fit(None, "sum")
    actual = _fit(kd.experimental.CentralStorageStrategy(cpus(2)), "sum")
    _assert_same(expected, actual)


@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_evaluate_equals_one_device(reduction):
    x, y, weights = _data(70)
    results = []
    for strategy in (None, kd.MirroredStrategy(cpus(4))):
        model = _in_scope(strategy, lambda: _model(reduction))
        model.set_weights([np.full(w.shape, 0.1, "float32") for w in model.get_weights()])
        results.append(model.evaluate(x, y, sample_weight=weights, batch_size=32, verbose=0))
    np.testing.assert_allclose(results[1], results[0], rtol=1e-5)


class _MeanOfUnreduced(keras.Model):
    """A model that reduces an unreduced (``reduction=None``) loss itself."""

    def compute_loss(self, x=None, y=None, y_pred=None, sample_weight=None, training=True):
        per_row = keras.losses.MeanSquaredError(reduction=None)(y, y_pred)
        return keras.ops.mean(per_row)


def test_unreduced_loss_with_custom_compute_loss_equals_one_device():
    x, y, _ = _data()

    def build():
        inputs = keras.Input((10,))
        model = _MeanOfUnreduced(inputs, keras.layers.Dense(1, kernel_initializer="ones")(inputs))
        model.compile(keras.optimizers.SGD(0.01))
        return model

    runs = []
    for strategy in (None, kd.MirroredStrategy(cpus(4))):
        model = _in_scope(strategy, build)
        history = model.fit(x, y, batch_size=32, epochs=2, shuffle=False, verbose=0)
        runs.append((history.history["loss"], model.get_weights()))
    _assert_same(*runs)


@pytest.mark.parametrize("reduction", ["sum", "sum_over_batch_size"])
def test_keras_loss_in_a_custom_loop_gives_one_device_gradients(engine, reduction):
    # As Keras on TensorFlow divides a mean-type loss by the replica count in a replica,
    # the replicas' gradients sum to the global batch's; a "sum" loss stays a sum.
    x, y, _ = _data(32)
    loss_object = keras.losses.MeanSquaredError(reduction=reduction)
    runs = []
    for strategy in (kd.get_strategy(), kd.MirroredStrategy(cpus(2))):
        with strategy.scope():
            model = keras.Sequential([keras.Input((10,)), keras.layers.Dense(1)])
            model.set_weights([np.full((10, 1), 0.1, "float32"), np.zeros(1, "float32")])
            optimizer = keras.optimizers.SGD(0.1)

        def step(batch, model=model, optimizer=optimizer):
            xb, yb = batch
            loss, grads = kd.value_and_grad(
                lambda: loss_object(yb, model(xb)), model.trainable_variables
            )()
            optimizer.apply(grads, model.trainable_variables)
            return loss

        losses = [
            float(strategy.reduce("SUM", strategy.run(step, args=(batch,)), axis=None))
            for batch in strategy.experimental_distribute_dataset([(x, y)] * 2)
        ]
        runs.append((losses, model.get_weights()))
    _assert_same(*runs)
