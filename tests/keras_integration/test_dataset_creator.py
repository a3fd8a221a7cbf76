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
    # TF's way: each element is one replica's batch of the global batch of 8.
    rng = np.random.default_rng(input_context.input_pipeline_id)
    batch = input_context.get_per_replica_batch_size(8)
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


def test_each_replica_reads_its_own_element_as_in_tf():
    # TF's distribute_datasets_from_function: 2 replicas take 2 elements of 4 rows, so a
    # step trains on 8 rows, as one device does on those rows in that order.
    strategy = kd.MirroredStrategy(cpus(2))
    keras.utils.set_random_seed(1)
    model = _model(strategy)
    first = model.get_weights()
    creator = kd.experimental.DatasetCreator(_dataset_fn)
    history = model.fit(creator, epochs=2, steps_per_epoch=5, verbose=0)

    reference = _model(kd.get_strategy())
    reference.set_weights(first)
    elements = _dataset_fn(kd.InputContext(1, 0, 2))
    rows = [next(elements) for _ in range(20)]  # 10 steps x 2 replicas, 4 rows each
    x = np.concatenate([x for x, _ in rows])
    y = np.concatenate([y for _, y in rows])
    # Epoch by epoch: 5 global batches each.
    expected = [
        reference.fit(x[i : i + 40], y[i : i + 40], batch_size=8, shuffle=False, verbose=0)
        for i in (0, 40)
    ]
    for got, want in zip(model.get_weights(), reference.get_weights()):
        np.testing.assert_allclose(got, want, atol=1e-6)
    np.testing.assert_allclose(
        history.history["loss"], [h.history["loss"][0] for h in expected], rtol=1e-5
    )
