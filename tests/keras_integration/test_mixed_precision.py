"""Mixed precision and optimizer features under a strategy give one device's numbers.

TF's mixed-precision guide trains with a ``LossScaleOptimizer`` in ``fit`` and in a
custom loop (``scale_loss``, then ``apply``); a step whose scaled gradients overflow is
skipped and the scale halved. Here one batch overflows (a huge target), the last batch is
partial (30 rows in batches of 8 on 4 replicas), and every result is compared with the
same loop on one device.
"""

import keras
import numpy as np
import pytest
from conftest import cpus

import keras_dist as kd

GLOBAL_BATCH = 8
# float16 sums of 2 rows (a replica) and of 8 rows (one device) round differently.
FP16_TOLERANCE = dict(rtol=1e-3, atol=1e-4)


@pytest.fixture(params=["mixed_float16", "mixed_bfloat16"])
def policy(request):
    previous = keras.config.dtype_policy()
    keras.config.set_dtype_policy(request.param)
    yield request.param
    keras.config.set_dtype_policy(previous)


def _data():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(30, 3)).astype("float32")
    y = x @ np.array([[1.0], [2.0], [-1.0]], "float32")
    if keras.config.dtype_policy().compute_dtype == "float16":
        y[5] = 1e6  # the first batch's scaled gradients overflow float16
    return x, y


def _model_and_optimizer():
    keras.utils.set_random_seed(1)
    model = keras.Sequential(
        [keras.Input((3,)), keras.layers.Dense(4), keras.layers.Dense(1, dtype="float32")]
    )
    optimizer = keras.optimizers.LossScaleOptimizer(
        keras.optimizers.SGD(0.01), initial_scale=2.0**8, dynamic_growth_steps=2
    )
    return model, optimizer


def _custom_loop(strategy, compile_with_function):
    """TF's mixed-precision custom loop, ported (``scale_loss`` replaces ``get_scaled_loss``)."""
    x, y = _data()
    with strategy.scope():
        model, optimizer = _model_and_optimizer()
    loss_object = keras.losses.MeanSquaredError(reduction=None)

    def train_step(batch):
        bx, by = batch

        def loss_fn():
            per_example = loss_object(by, model(bx, training=True))
            loss = kd.nn.compute_average_loss(per_example, global_batch_size=GLOBAL_BATCH)
            return optimizer.scale_loss(loss), loss

        (_, loss), grads = kd.value_and_grad(loss_fn, model.trainable_variables, has_aux=True)()
        optimizer.apply(grads, model.trainable_variables)
        return loss

    def distributed_train_step(batch):
        return strategy.reduce("SUM", strategy.run(train_step, args=(batch,)), axis=None)

    if compile_with_function:
        distributed_train_step = kd.function(distributed_train_step)
    batches = [(x[i : i + GLOBAL_BATCH], y[i : i + GLOBAL_BATCH]) for i in range(0, 30, 8)]
    losses = [
        float(distributed_train_step(b)) for b in strategy.experimental_distribute_dataset(batches)
    ]
    return losses, model, optimizer


def _assert_same_training(result, expected, policy):
    (losses, model, optimizer), (losses_1, model_1, optimizer_1) = result, expected
    tolerance = FP16_TOLERANCE if policy == "mixed_float16" else dict(rtol=2e-2, atol=2e-3)
    np.testing.assert_allclose(losses, losses_1, **tolerance)
    for variable, reference in zip(model.trainable_variables, model_1.trainable_variables):
        np.testing.assert_allclose(np.asarray(variable), np.asarray(reference), **tolerance)
    assert int(optimizer.iterations.numpy()) == int(optimizer_1.iterations.numpy())
    assert float(optimizer.dynamic_scale.numpy()) == float(optimizer_1.dynamic_scale.numpy())


@pytest.mark.parametrize("compile_with_function", [True, False], ids=["kd_function", "run"])
def test_loss_scale_custom_loop_equals_one_device(policy, engine, compile_with_function):
    expected = _custom_loop(kd.get_strategy(), compile_with_function)
    result = _custom_loop(kd.MirroredStrategy(cpus(4)), compile_with_function)
    _assert_same_training(result, expected, policy)
    losses, _, optimizer = result
    if policy == "mixed_float16":
        # The first step overflowed: skipped (3 of 4 applied), the scale halved to 128,
        # then doubled after 2 finite steps.
        assert losses[0] > 1e10
        assert int(optimizer.iterations.numpy()) == 3
        assert float(optimizer.dynamic_scale.numpy()) == 256.0


def _fit(strategy):
    x, y = _data()
    with strategy.scope():
        model, optimizer = _model_and_optimizer()
        model.compile(optimizer=optimizer, loss="mse")
    history = model.fit(x, y, batch_size=GLOBAL_BATCH, epochs=2, shuffle=False, verbose=0)
    return history.history["loss"], model, optimizer


def test_loss_scale_fit_equals_one_device(policy):
    _assert_same_training(_fit(kd.MirroredStrategy(cpus(4))), _fit(kd.get_strategy()), policy)


@pytest.mark.timeout(180)
def test_loss_scale_fit_under_parameter_servers_equals_one_device():
    # One worker runs the steps in order: its numbers are one device's, skipped step included.
    previous = keras.config.dtype_policy()
    keras.config.set_dtype_policy("mixed_float16")
    try:
        strategy = kd.ParameterServerStrategy(
            kd.testing.create_in_process_cluster(num_workers=1, num_ps=1)
        )
        _assert_same_training(_fit(strategy), _fit(kd.get_strategy()), "mixed_float16")
    finally:
        keras.config.set_dtype_policy(previous)


# ------------------------------------------------- optimizer features (float32)
def _train_with(strategy, make_optimizer, epochs=3):
    rng = np.random.default_rng(3)
    x = rng.normal(size=(36, 5)).astype("float32")
    y = (x @ rng.normal(size=(5, 2))).astype("float32")
    keras.utils.set_random_seed(2)
    with strategy.scope():
        model = keras.Sequential(
            [keras.Input((5,)), keras.layers.Dense(8, activation="relu"), keras.layers.Dense(2)]
        )
        model.compile(optimizer=make_optimizer(), loss="mse")
    history = model.fit(x, y, batch_size=8, epochs=epochs, shuffle=False, verbose=0)
    return history.history["loss"], model


OPTIMIZERS = {
    "gradient_accumulation": lambda: keras.optimizers.SGD(0.05, gradient_accumulation_steps=2),
    "ema": lambda: keras.optimizers.Adam(0.01, use_ema=True, ema_momentum=0.9),
    "global_clipnorm": lambda: keras.optimizers.SGD(0.1, global_clipnorm=0.5),
    "weight_decay_exclusions": lambda: _adamw_without_bias_decay(),
}


def _adamw_without_bias_decay():
    optimizer = keras.optimizers.AdamW(0.01, weight_decay=0.1)
    optimizer.exclude_from_weight_decay(var_names=["bias"])
    return optimizer


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_optimizer_features_equal_one_device(name):
    losses_1, model_1 = _train_with(kd.get_strategy(), OPTIMIZERS[name])
    losses, model = _train_with(kd.MirroredStrategy(cpus(4)), OPTIMIZERS[name])
    np.testing.assert_allclose(losses, losses_1, rtol=1e-6, atol=1e-6)
    for variable, reference in zip(model.variables, model_1.variables):
        np.testing.assert_allclose(np.asarray(variable), np.asarray(reference), atol=1e-6)
    for variable, reference in zip(model.optimizer.variables, model_1.optimizer.variables):
        np.testing.assert_allclose(np.asarray(variable), np.asarray(reference), atol=1e-6)


def test_swap_ema_weights_under_a_strategy_equals_one_device():
    def train(strategy):
        rng = np.random.default_rng(4)
        x = rng.normal(size=(32, 3)).astype("float32")
        y = x.sum(axis=1, keepdims=True)
        keras.utils.set_random_seed(5)
        with strategy.scope():
            model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
            model.compile(optimizer=keras.optimizers.SGD(0.1, use_ema=True), loss="mse")
        swap = keras.callbacks.SwapEMAWeights(swap_on_epoch=True)
        history = model.fit(
            x, y, batch_size=8, epochs=2, validation_data=(x, y), callbacks=[swap], verbose=0
        )
        return history.history, [np.asarray(v) for v in model.trainable_variables]

    history_1, weights_1 = train(kd.get_strategy())
    history, weights = train(kd.MirroredStrategy(cpus(4)))
    for key in history_1:
        np.testing.assert_allclose(history[key], history_1[key], rtol=1e-6)
    for variable, reference in zip(weights, weights_1):
        np.testing.assert_allclose(variable, reference, atol=1e-6)


@pytest.mark.parametrize("compile_with_function", [False, True], ids=["eager", "kd.function"])
def test_two_optimizers_for_two_layers_equal_one_device(compile_with_function):
    # Keras 3 has no MultiOptimizer: a custom loop applies one optimizer per group of variables.
    def train(strategy, wrap):
        rng = np.random.default_rng(0)
        x = rng.normal(size=(30, 4)).astype("float32")
        y = rng.normal(size=(30, 1)).astype("float32")
        keras.utils.set_random_seed(1)
        with strategy.scope():
            model = keras.Sequential(
                [keras.Input((4,)), keras.layers.Dense(6, activation="relu"), keras.layers.Dense(1)]
            )
            hidden, head = model.layers[0].trainable_variables, model.layers[1].trainable_variables
            adam, sgd = keras.optimizers.Adam(0.01), keras.optimizers.SGD(0.1, momentum=0.9)
            adam.build(hidden)
            sgd.build(head)

        def step(xb, yb):
            def loss_fn():
                return keras.ops.sum(keras.ops.square(model(xb) - yb)) / len(x)

            loss, grads = kd.value_and_grad(loss_fn, hidden + head)()
            adam.apply(grads[: len(hidden)], hidden)
            sgd.apply(grads[len(hidden) :], head)
            return loss

        @wrap
        def distributed_step(xb, yb):
            return strategy.reduce("SUM", strategy.run(step, args=(xb, yb)), axis=None)

        batches = [(x[i : i + 8], y[i : i + 8]) for i in range(0, len(x), 8)]  # last one has 6 rows
        dataset = strategy.experimental_distribute_dataset(batches)
        losses = [float(distributed_step(xb, yb)) for _ in range(2) for xb, yb in dataset]
        return losses, [np.asarray(v) for v in model.trainable_variables + adam.variables]

    losses_1, state_1 = train(kd.get_strategy(), lambda f: f)
    wrap = kd.function if compile_with_function else (lambda f: f)
    losses, state = train(kd.MirroredStrategy(cpus(4)), wrap)
    np.testing.assert_allclose(losses, losses_1, rtol=1e-6, atol=1e-7)
    for value, reference in zip(state, state_1):
        np.testing.assert_allclose(value, reference, atol=1e-6)
