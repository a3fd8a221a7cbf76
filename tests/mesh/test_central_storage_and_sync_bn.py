"""CentralStorageStrategy gives MirroredStrategy's numbers; SyncBatchNormalization one device's."""

import keras
import numpy as np
import pytest
from conftest import cpus

import keras_dist as kd
from keras_dist._values._variables import numpy_components


def _fit(strategy, layer_cls=keras.layers.BatchNormalization, clipnorm=None, rows=70):
    keras.utils.set_random_seed(2)
    with strategy.scope():
        model = keras.Sequential(
            [
                keras.Input((3,)),
                keras.layers.Dense(4),
                layer_cls(momentum=0.5),
                keras.layers.Dense(1),
            ]
        )
        model.compile(
            loss="mse",
            optimizer=keras.optimizers.SGD(0.01, clipnorm=clipnorm),
            metrics=["mae"],
        )
    rng = np.random.default_rng(0)
    x = (rng.normal(size=(rows, 3)) * np.arange(1, rows + 1)[:, None] / 10).astype("float32")
    y = x.sum(1, keepdims=True)
    history = model.fit(x, y, batch_size=16, epochs=2, verbose=0, shuffle=False)
    return history.history, [w.numpy() for w in model.weights], model


def test_central_storage_keeps_variables_on_the_parameter_device():
    strategy = kd.experimental.CentralStorageStrategy(cpus(4), parameter_device="/cpu:5")
    assert strategy.num_replicas_in_sync == 4
    assert strategy.extended.parameter_devices == ("/job:localhost/replica:0/task:0/device:CPU:5",)
    assert strategy.cluster_resolver is None
    _, _, model = _fit(strategy)
    for variable in model.trainable_variables:
        assert {d.id for d in variable.value.sharding.device_set} == {5}


@pytest.mark.parametrize("parameter_device", [None, "/cpu:5"])
def test_central_storage_model_called_after_fit_gives_its_weights_result(parameter_device):
    # Batch norm's moving statistics (per replica) are read where the other variables
    # are: calling the model after fit mixed devices and failed deep in JAX.
    strategy = kd.experimental.CentralStorageStrategy(cpus(4), parameter_device=parameter_device)
    _, _, model = _fit(strategy)
    x = np.linspace(-1, 1, 15, dtype="float32").reshape(5, 3)
    kernel, bias = model.layers[0].get_weights()
    gamma, beta, mean, variance = model.layers[1].get_weights()
    dense = x @ kernel + bias
    for training, (m, v) in [(False, (mean, variance)), (True, (dense.mean(0), dense.var(0)))]:
        normalized = (dense - m) / np.sqrt(v + 1e-3) * gamma + beta
        want = normalized @ model.layers[2].get_weights()[0] + model.layers[2].get_weights()[1]
        np.testing.assert_allclose(model(x, training=training), want, rtol=1e-5, atol=1e-5)
    bn = model.layers[1]
    gamma, _, _, variance = bn.get_weights()  # (the training call moved the statistics)
    np.testing.assert_allclose(bn.moving_variance * 2 + bn.gamma, variance * 2 + gamma)


@pytest.mark.parametrize("clipnorm", [None, 1.0])
def test_central_storage_equals_mirrored(clipnorm):
    mirrored = _fit(kd.MirroredStrategy(cpus(4)), clipnorm=clipnorm)
    central = _fit(kd.experimental.CentralStorageStrategy(cpus(4)), clipnorm=clipnorm)
    for key in mirrored[0]:
        np.testing.assert_allclose(central[0][key], mirrored[0][key], atol=1e-6)
    for got, want in zip(central[1], mirrored[1]):
        np.testing.assert_allclose(got, want, atol=1e-6)


def test_central_storage_aggregation_rules(engine):
    # Spec 42: SUM x=10 with assign_add(1) per replica -> 10 + n; ONLY_FIRST z=30 -> 31.
    strategy = kd.experimental.CentralStorageStrategy(cpus(4))
    with strategy.scope():
        x = keras.Variable(10.0, aggregation="sum")
        z = keras.Variable(30.0, aggregation="only_first_replica")
        step = keras.Variable(0, dtype="int64", aggregation="only_first_replica")

    def fn():
        x.assign_add(keras.ops.ones(()))  # a tensor of each replica (a Python 1.0 is refused)
        z.assign_add(1.0)
        step.assign_add(1)

    strategy.run(fn)
    assert float(x.numpy()) == 14.0
    assert float(z.numpy()) == 31.0
    assert int(step.numpy()) == 1


def test_sync_batch_norm_equals_one_device_batch_norm():
    reference = _fit(kd.OneDeviceStrategy("/cpu:0"), rows=64)
    synced = _fit(kd.MirroredStrategy(cpus(4)), kd.layers.SyncBatchNormalization, rows=64)
    assert synced[0]["loss"] == pytest.approx(reference[0]["loss"], rel=1e-5)
    for got, want in zip(synced[1], reference[1]):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_batch_norm_statistics_are_per_replica_by_default():
    reference = _fit(kd.OneDeviceStrategy("/cpu:0"), rows=64)
    mirrored = _fit(kd.MirroredStrategy(cpus(4)), rows=64)
    moving_mean = mirrored[2].layers[1].moving_mean
    assert isinstance(moving_mean, kd.SyncOnReadVariable)
    assert moving_mean.aggregation == "mean"
    components = numpy_components(moving_mean)
    assert not np.allclose(components[0], components[3])
    np.testing.assert_allclose(moving_mean.numpy(), np.mean(components, axis=0), rtol=1e-6)
    # Per-replica statistics train differently from one device's (TF's behaviour).
    assert not np.allclose(mirrored[1][0], reference[1][0])


def test_sync_batch_norm_outside_a_strategy_is_batch_norm():
    layer = kd.layers.SyncBatchNormalization()
    reference = keras.layers.BatchNormalization()
    x = np.random.default_rng(0).normal(size=(8, 3)).astype("float32")
    np.testing.assert_allclose(
        layer(x, training=True), reference(x, training=True), rtol=1e-6, atol=1e-6
    )


def test_sync_batch_norm_refuses_an_uneven_eager_gradient():
    strategy = kd.MirroredStrategy(cpus(2))
    with strategy.scope():
        model = keras.Sequential(
            [keras.Input((2,)), keras.layers.Dense(2), kd.layers.SyncBatchNormalization()]
        )
    batches = [np.ones((3, 2), "float32")]  # 2 rows and 1 row: the eager engine

    def step(x):
        loss_fn = lambda: keras.ops.sum(model(x, training=True))  # noqa: E731
        return kd.value_and_grad(loss_fn, model.trainable_variables)()[0]

    for batch in strategy.experimental_distribute_dataset(batches):
        with pytest.raises(RuntimeError, match="eager engine.s replica threads"):
            strategy.run(step, args=(batch,))
