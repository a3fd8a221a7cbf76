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


class _TensorStandIn:
    """Looks like a ``tf.Tensor`` to keras_dist and Keras: TF's module, ``__array__``, and a
    dtype NumPy cannot read (``tf.float32``)."""

    __module__ = "tensorflow.python.framework.ops"
    dtype = object()

    def __init__(self, value):
        self._value = np.asarray(value)

    def __array__(self, dtype=None, copy=None):
        return self._value if dtype is None else self._value.astype(dtype)


X = np.random.default_rng(7).normal(size=(16, 3)).astype("float32")
Y = X.sum(axis=1, keepdims=True) * 0.5


def _tensor_pipeline(with_targets, tensor=_TensorStandIn):
    """A ``dataset_fn`` whose elements are tensors: the replica's rows of each global batch
    of 8, in order, so the replicas' elements joined are ``X``'s batches of 8."""

    def dataset_fn(input_context):
        batch = input_context.get_per_replica_batch_size(8)
        for start in range(0, len(X), batch):
            rows = slice(start, start + batch)
            yield (tensor(X[rows]), tensor(Y[rows])) if with_targets else tensor(X[rows])

    return dataset_fn


def _tf_pipeline(with_targets):
    tf = pytest.importorskip("tensorflow")

    def dataset_fn(input_context):
        batch = input_context.get_per_replica_batch_size(8)
        data = (X, Y) if with_targets else X
        return tf.data.Dataset.from_tensor_slices(data).batch(batch)

    return dataset_fn


_CREATOR_STRATEGIES = {
    "default": kd.get_strategy,
    "one_device": lambda: kd.OneDeviceStrategy("/cpu:0"),
    "mirrored": lambda: kd.MirroredStrategy(cpus(2)),
    "central_storage": lambda: kd.experimental.CentralStorageStrategy(cpus(2)),
}


@pytest.mark.parametrize("pipeline", ["stand_in", "tensorflow"])
@pytest.mark.parametrize("strategy_name", list(_CREATOR_STRATEGIES))
def test_tensor_pipelines_in_fit_evaluate_predict_equal_plain_keras(strategy_name, pipeline):
    # The default and one-device strategies handed Keras a step's bare tf.Tensor, which
    # its PyDataset adapter refuses ("must return a tuple or a dict").
    make = _tensor_pipeline if pipeline == "stand_in" else _tf_pipeline
    keras.utils.set_random_seed(5)
    reference = _model(kd.get_strategy())
    first = reference.get_weights()
    want_predictions = reference.predict(X, batch_size=8, verbose=0)
    want_evaluation = reference.evaluate(X, Y, batch_size=8, verbose=0)
    want_history = reference.fit(X, Y, batch_size=8, epochs=2, shuffle=False, verbose=0)

    model = _model(_CREATOR_STRATEGIES[strategy_name]())
    model.set_weights(first)
    predictions = model.predict(
        kd.experimental.DatasetCreator(make(with_targets=False)), steps=2, verbose=0
    )
    np.testing.assert_allclose(predictions, want_predictions, rtol=1e-6)
    creator = kd.experimental.DatasetCreator(make(with_targets=True))
    np.testing.assert_allclose(
        model.evaluate(creator, steps=2, verbose=0), want_evaluation, rtol=1e-6
    )
    history = model.fit(creator, epochs=2, steps_per_epoch=2, verbose=0)
    np.testing.assert_allclose(history.history["loss"], want_history.history["loss"], rtol=1e-5)
    for got, want in zip(model.get_weights(), reference.get_weights()):
        np.testing.assert_allclose(got, want, atol=1e-6)
