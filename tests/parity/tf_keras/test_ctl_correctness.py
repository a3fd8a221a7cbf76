"""tf-keras's ``ctl_correctness_test.py``: a custom training loop gives one device's numbers.

``GradientTape`` -> ``kd.value_and_grad``, ``tf.function`` -> ``kd.function``, the
``tf.data`` dataset -> its list of batches, ``BatchNormalization(synchronized=True)`` ->
``kd.layers.SyncBatchNormalization``.
"""

import keras
import numpy as np
import pytest

import keras_dist as kd

from ._correctness import scope
from ._strategies import ALL
from ._strategies import params

NUM_SAMPLES = 66
BATCH_SIZE = 32
RANDOM_SEED = 1337
NUM_EPOCHS = 2
STEPS_PER_EPOCH = 2
FULL = pytest.mark.tf_keras_full


def get_model(sync_batchnorm=False):
    batch_norm = kd.layers.SyncBatchNormalization if sync_batchnorm else (
        keras.layers.BatchNormalization
    )  # fmt: skip
    return keras.Sequential(
        [
            keras.Input((1,)),
            keras.layers.Dense(10, activation="relu"),
            keras.layers.Dense(
                10, activation="relu", kernel_regularizer=keras.regularizers.l2(1e-4)
            ),
            batch_norm(),
            keras.layers.Dense(10, activation="relu"),
            keras.layers.Dense(1),
        ]
    )


def get_data():
    x_train = np.random.rand(NUM_SAMPLES, 1)
    y_train = (3 * x_train).astype("float32")
    x_train = x_train.astype("float32")
    return [
        (x_train[i : i + BATCH_SIZE], y_train[i : i + BATCH_SIZE])
        for i in range(0, NUM_SAMPLES, BATCH_SIZE)
    ]


def compute_loss(labels, logits, reg_losses):
    pred_loss = keras.losses.mean_squared_error(labels, logits)
    scaled_loss = kd.nn.compute_average_loss(pred_loss, global_batch_size=BATCH_SIZE)
    l2_loss = kd.nn.scale_regularization_loss(reg_losses)
    return scaled_loss + l2_loss


def _step_fn(model, optimizer, training_accuracy):
    def step_fn(inputs):
        samples, labels = inputs

        def loss_fn():
            logits = model(samples)
            return compute_loss(labels, logits, model.losses), logits

        (loss, logits), grads = kd.value_and_grad(
            loss_fn, model.trainable_variables, has_aux=True
        )()
        optimizer.apply_gradients(zip(grads, model.trainable_variables))
        training_accuracy.update_state(labels, logits)
        return loss

    return step_fn


def _model_and_optimizer(initial_weights, optimizer_fn, sync_batchnorm):
    model = get_model(sync_batchnorm)
    model.set_weights(initial_weights)
    return model, optimizer_fn(), keras.metrics.CategoricalAccuracy("training_accuracy")


def iteration_inside_func(initial_weights, dataset, optimizer_fn, iteration_type,
                          strategy=None, sync_batchnorm=None):  # fmt: skip
    """Iterates over the data inside a ``kd.function``."""
    with scope(strategy):
        model, optimizer, training_accuracy = _model_and_optimizer(
            initial_weights, optimizer_fn, bool(strategy and sync_batchnorm)
        )
        step_fn = _step_fn(model, optimizer, training_accuracy)

        def one_step(x):
            if strategy:
                per_replica_losses = strategy.run(step_fn, args=(x,))
                return strategy.reduce(kd.ReduceOp.SUM, per_replica_losses, axis=None)
            return step_fn(x)

        @kd.function
        def train_epoch(dist_input):
            total_loss = 0.0
            num_batches = 0
            if iteration_type == "dataset":
                for x in dist_input:
                    total_loss += one_step(x)
                    num_batches += 1
            else:
                iterator = iter(dist_input)
                for _ in range(STEPS_PER_EPOCH):
                    total_loss += one_step(next(iterator))
                    num_batches += 1
            return total_loss / num_batches

        if strategy:
            dataset = strategy.experimental_distribute_dataset(dataset)
        for _ in range(NUM_EPOCHS):
            loss = train_epoch(dataset)
        return model.get_weights(), loss, training_accuracy.result()


def iteration_outside_func(initial_weights, dataset, optimizer_fn, iteration_type,
                           strategy=None, sync_batchnorm=None):  # fmt: skip
    """Iterates over the data in Python, one ``kd.function`` call a step."""
    with scope(strategy):
        model, optimizer, training_accuracy = _model_and_optimizer(
            initial_weights, optimizer_fn, sync_batchnorm
        )
        step_fn = _step_fn(model, optimizer, training_accuracy)

        @kd.function
        def train_step(dist_inputs):
            if strategy:
                per_replica_losses = strategy.run(step_fn, args=(dist_inputs,))
                return strategy.reduce(kd.ReduceOp.SUM, per_replica_losses, axis=None)
            return step_fn(dist_inputs)

        if strategy:
            dataset = strategy.experimental_distribute_dataset(dataset)
        total_loss = 0.0
        num_batches = 0
        for _ in range(NUM_EPOCHS):
            if iteration_type == "dataset":
                for x in dataset:
                    total_loss += train_step(x)
                    num_batches += 1
            else:
                iterator = iter(dataset)
                for _ in range(STEPS_PER_EPOCH):
                    total_loss += train_step(next(iterator))
                    num_batches += 1
        return model.get_weights(), total_loss / num_batches, training_accuracy.result()


# optimizer_combinations.optimizers_v2 (the legacy optimizers, as Keras 3's).
OPTIMIZERS = [
    pytest.param(lambda: keras.optimizers.SGD(0.001), id="sgd"),
    pytest.param(lambda: keras.optimizers.Adagrad(0.001), id="adagrad", marks=FULL),
]


@pytest.mark.parametrize("sync_batchnorm", [True, False], ids=["sync_bn", "bn"])
@pytest.mark.parametrize(
    "inside_func", [False, pytest.param(True, marks=FULL)], ids=["outside", "inside"]
)
@pytest.mark.parametrize("iteration_type", ["iterator", "dataset"])
@pytest.mark.parametrize("optimizer_fn", OPTIMIZERS)
@pytest.mark.parametrize("strategy", params(ALL, ci=["mirrored2"]), indirect=True)
def test_dnn_correctness_minus_tpus(
    strategy, optimizer_fn, iteration_type, inside_func, sync_batchnorm
):
    np.random.seed(RANDOM_SEED)
    keras.utils.set_random_seed(RANDOM_SEED)
    initial_weights = get_model(sync_batchnorm).get_weights()
    dataset = get_data()
    iteration_func = iteration_inside_func if inside_func else iteration_outside_func
    wts_with_ds, loss_with_ds, acc_with_ds = iteration_func(
        initial_weights, dataset, optimizer_fn, iteration_type, strategy, sync_batchnorm
    )
    wts, loss, acc = iteration_func(
        initial_weights, dataset, optimizer_fn, iteration_type, sync_batchnorm=sync_batchnorm
    )
    for actual, expected in zip(wts_with_ds, wts):
        np.testing.assert_allclose(actual, expected, atol=1e-3, rtol=1e-3)
    np.testing.assert_allclose(float(loss_with_ds), float(loss), atol=1e-3, rtol=1e-3)
    np.testing.assert_allclose(float(acc_with_ds), float(acc), atol=1e-3, rtol=1e-3)
