"""``DatasetCreator`` in ``fit`` under every strategy (spec 89), and TF's error without steps."""

import keras
import numpy as np
import pytest
from conftest import cpus

import keras_dist as kd

TF_MESSAGE = (
    "When using a `tf.keras.utils.experimental.DatasetCreator`, `steps_per_epoch`, "
    "`validation_steps`, `steps`, or `pss_evaluation_shards` argument must be provided"
)


def _dataset_fn(input_context):
    rng = np.random.default_rng(input_context.input_pipeline_id)
    batch = input_context.get_per_replica_batch_size(8) * input_context.num_replicas_in_sync
    while True:
        x = rng.normal(size=(batch, 3)).astype("float32")
        yield x, x.sum(axis=1, keepdims=True)


def _model(strategy):
    with strategy.scope():
        model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
        model.compile(keras.optimizers.SGD(0.05), loss="mse")
    return model


@pytest.mark.parametrize(
    "make_strategy",
    [lambda: kd.MirroredStrategy(cpus(2)), lambda: kd.OneDeviceStrategy("/cpu:0"), lambda: None],
    ids=["mirrored", "one-device", "no-strategy"],
)
def test_spec_89_ten_epochs_of_ten_steps_give_100_iterations(make_strategy):
    strategy = make_strategy()
    model = _model(strategy) if strategy is not None else _model(kd.get_strategy())
    creator = kd.experimental.DatasetCreator(_dataset_fn)
    history = model.fit(creator, epochs=10, steps_per_epoch=10, verbose=0)
    assert int(model.optimizer.iterations.numpy()) == 100
    assert history.history["loss"][-1] < history.history["loss"][0]
    assert np.isfinite(model.evaluate(creator, steps=3, verbose=0))


def test_spec_89_omitting_the_steps_raises_tfs_error():
    model = _model(kd.MirroredStrategy(cpus(2)))
    creator = kd.experimental.DatasetCreator(_dataset_fn)
    with pytest.raises(ValueError, match=r"When using a `tf\.keras\.utils\.experimental"):
        model.fit(creator, epochs=1, verbose=0)
    with pytest.raises(ValueError) as raised:
        model.evaluate(creator, verbose=0)
    assert TF_MESSAGE in str(raised.value)
    x = np.ones((8, 3), "float32")
    with pytest.raises(ValueError, match="validation_data=DatasetCreator"):
        model.fit(x, x[:, :1], epochs=1, validation_data=creator, verbose=0)
