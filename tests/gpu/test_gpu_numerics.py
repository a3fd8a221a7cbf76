"""On GPUs, keras_dist gives one GPU's numbers: fit, the custom loop, mixed precision, collectives.

Skipped, with the reason, where JAX sees no GPU (CI, this repository's CPU
machines). Run them on a GPU machine with ``pytest -m gpu tests/gpu``. The
strategies use every GPU JAX sees; the reference is the same program without a
strategy, on the default device (the first GPU).
"""

import jax
import keras
import numpy as np
import pytest

import keras_dist as kd


def _gpus():
    try:
        return jax.devices("gpu")
    except RuntimeError:  # no GPU backend in this jaxlib, or no GPU
        return []


GPUS = _gpus()
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not GPUS,
        reason=f"needs a GPU; JAX sees only {sorted({d.platform for d in jax.devices()})} devices",
    ),
]

GLOBAL_BATCH = 8
TOLERANCE = {
    # Several GPUs sum gradients in another order than one; float16 rounds coarser.
    "float32": dict(rtol=1e-5, atol=1e-6),
    "mixed_float16": dict(rtol=1e-3, atol=1e-4),
    "mixed_bfloat16": dict(rtol=2e-2, atol=2e-3),
}


@pytest.fixture(params=["float32", "mixed_float16", "mixed_bfloat16"])
def policy(request):
    previous = keras.config.dtype_policy()
    keras.config.set_dtype_policy(request.param)
    yield request.param
    keras.config.set_dtype_policy(previous)


def _data(policy):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(30, 3)).astype("float32")  # the last batch of 8 is partial
    y = x @ np.array([[1.0], [2.0], [-1.0]], "float32")
    if policy == "mixed_float16":
        y[5] = 1e6  # the first batch's scaled gradients overflow float16: the step is skipped
    return x, y


def _model_and_optimizer(policy):
    keras.utils.set_random_seed(1)
    model = keras.Sequential(
        [keras.Input((3,)), keras.layers.Dense(16), keras.layers.Dense(1, dtype="float32")]
    )
    optimizer = keras.optimizers.SGD(0.01)
    if policy == "mixed_float16":
        optimizer = keras.optimizers.LossScaleOptimizer(
            optimizer, initial_scale=2.0**8, dynamic_growth_steps=2
        )
    return model, optimizer


def _fit(strategy, policy):
    x, y = _data(policy)
    with strategy.scope():
        model, optimizer = _model_and_optimizer(policy)
        model.compile(optimizer=optimizer, loss="mse")
    history = model.fit(x, y, batch_size=GLOBAL_BATCH, epochs=2, shuffle=False, verbose=0)
    return history.history["loss"], model, optimizer


def _custom_loop(strategy, policy):
    """TF's mixed-precision custom loop, ported: ``scale_loss``, then ``apply``."""
    x, y = _data(policy)
    with strategy.scope():
        model, optimizer = _model_and_optimizer(policy)
    loss_object = keras.losses.MeanSquaredError(reduction=None)
    scale = getattr(optimizer, "scale_loss", lambda loss: loss)

    def train_step(batch):
        bx, by = batch

        def loss_fn():
            per_example = loss_object(by, model(bx, training=True))
            loss = kd.nn.compute_average_loss(per_example, global_batch_size=GLOBAL_BATCH)
            return scale(loss), loss

        (_, loss), grads = kd.value_and_grad(loss_fn, model.trainable_variables, has_aux=True)()
        optimizer.apply(grads, model.trainable_variables)
        return loss

    @kd.function
    def distributed_train_step(batch):
        return strategy.reduce("SUM", strategy.run(train_step, args=(batch,)), axis=None)

    batches = [(x[i : i + GLOBAL_BATCH], y[i : i + GLOBAL_BATCH]) for i in range(0, 30, 8)]
    dataset = strategy.experimental_distribute_dataset(batches)
    losses = [float(distributed_train_step(batch)) for batch in dataset]
    return losses, model, optimizer


def _assert_same_training(result, expected, policy):
    (losses, model, optimizer), (losses_1, model_1, optimizer_1) = result, expected
    np.testing.assert_allclose(losses, losses_1, **TOLERANCE[policy])
    for variable, reference in zip(model.trainable_variables, model_1.trainable_variables):
        np.testing.assert_allclose(np.asarray(variable), np.asarray(reference), **TOLERANCE[policy])
    assert int(optimizer.iterations.numpy()) == int(optimizer_1.iterations.numpy())


def _platforms(variable):
    return {device.platform for device in variable.value.devices()}


@pytest.mark.parametrize("run", [_fit, _custom_loop], ids=["fit", "custom_loop"])
def test_training_on_every_gpu_equals_one_gpu(run, policy):
    strategy = kd.MirroredStrategy()
    assert list(strategy.extended.local_devices) == GPUS
    result = run(strategy, policy)
    expected = run(kd.get_strategy(), policy)
    _assert_same_training(result, expected, policy)
    assert _platforms(result[1].trainable_variables[0]) == {"gpu"}
    if policy == "mixed_float16":  # the overflowing batch's steps were skipped
        steps = 8 if run is _fit else 4
        assert int(result[2].iterations.numpy()) < steps
        assert float(result[0][0]) > 1e10


def test_all_reduce_on_every_gpu_sums_every_replica():
    strategy = kd.MirroredStrategy()
    n = strategy.num_replicas_in_sync

    def replica_step():
        context = kd.get_replica_context()
        value = keras.ops.full((1024,), context.replica_id_in_sync_group + 1.0)
        return context.all_reduce("SUM", value)

    step = kd.function(lambda: strategy.run(replica_step))
    for result in strategy.experimental_local_results(step()):
        np.testing.assert_array_equal(np.asarray(result), np.full(1024, n * (n + 1) / 2))
        assert {device.platform for device in result.devices()} == {"gpu"}
