"""A loop's steps: -1 reads the input to its end (tf-keras's), and an input that never
ends is refused without steps, on every strategy, against one device's numbers."""

import itertools
import sys
import warnings

import grain
import keras
import numpy as np
import pytest
from conftest import cpus

import keras_dist as kd

X = np.random.default_rng(3).normal(size=(32, 3)).astype("float32")
Y = X.sum(axis=1, keepdims=True) * 0.5

STRATEGIES = {
    "default": kd.get_strategy,
    "one_device": lambda: kd.OneDeviceStrategy("/cpu:0"),
    "mirrored": lambda: kd.MirroredStrategy(cpus(2)),
    "central_storage": lambda: kd.experimental.CentralStorageStrategy(cpus(2)),
    "multi_worker_mirrored": lambda: kd.MultiWorkerMirroredStrategy(),
}


class _Batches(keras.utils.PyDataset):
    def __len__(self):
        return 4

    def __getitem__(self, index):
        return X[index * 8 : (index + 1) * 8], Y[index * 8 : (index + 1) * 8]


class _UnknownLength:
    """Re-iterable batches that do not say how many there are (a generator's)."""

    def __iter__(self):
        return ((X[i : i + 8], Y[i : i + 8]) for i in range(0, 32, 8))


class _EndlessTFStandIn:
    """Looks like ``tf.data.Dataset.repeat()`` to keras_dist: TF's module, infinite
    ``cardinality()`` (tf.data.INFINITE_CARDINALITY)."""

    __module__ = "tensorflow.python.data.ops.dataset_ops"

    def cardinality(self):
        return np.int64(-1)

    def __iter__(self):
        return ((X[i : i + 8], Y[i : i + 8]) for i in itertools.cycle(range(0, 32, 8)))


def _model(strategy, weights=None):
    keras.utils.set_random_seed(11)
    with strategy.scope():
        model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
        model.compile(keras.optimizers.SGD(0.05), loss="mse")
    if weights is not None:
        model.set_weights(weights)
    return model


class _BatchNumbers(keras.callbacks.Callback):
    def __init__(self):
        super().__init__()
        self.seen = []

    def on_train_batch_end(self, batch, logs=None):
        self.seen.append(batch)


@pytest.fixture(scope="module")
def one_device():
    """Plain Keras on one device: 2 epochs over X in batches of 8, in order."""
    model = _model(kd.get_strategy())
    first = model.get_weights()
    history = model.fit(X, Y, batch_size=8, epochs=2, shuffle=False, verbose=0)
    evaluation = model.evaluate(X, Y, batch_size=8, verbose=0)
    predictions = model.predict(X, batch_size=8, verbose=0)
    return first, history.history["loss"], model.get_weights(), evaluation, predictions


def _source(name, strategy):
    if name == "pydataset":
        return _Batches()
    if name == "numpy_dataset":
        return strategy.experimental_make_numpy_dataset((X, Y)).batch(8)
    return strategy.experimental_distribute_dataset(_UnknownLength())


@pytest.mark.parametrize("source", ["pydataset", "numpy_dataset", "distributed"])
@pytest.mark.parametrize("strategy_name", list(STRATEGIES))
def test_minus_one_reads_the_data_to_its_end(one_device, strategy_name, source):
    # Keras 3 took -1 as a count: callbacks saw batch -2 and each epoch "ran out of data".
    first, losses, weights, evaluation, predictions = one_device
    strategy = STRATEGIES[strategy_name]()
    model = _model(strategy, first)
    batches = _BatchNumbers()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # (unknown length: read to its end)
        history = model.fit(
            _source(source, strategy),
            steps_per_epoch=-1,
            epochs=2,
            shuffle=False,
            callbacks=[batches],
            verbose=0,
        )
        got_evaluation = model.evaluate(_source(source, strategy), steps=-1, verbose=0)
        x_only = strategy.experimental_make_numpy_dataset(X).batch(8)
        got_predictions = model.predict(x_only, steps=-1, verbose=0)
    assert batches.seen == [0, 1, 2, 3] * 2
    assert int(model.optimizer.iterations.numpy()) == 8
    np.testing.assert_allclose(history.history["loss"], losses, rtol=1e-5)
    for got, want in zip(model.get_weights(), weights):
        np.testing.assert_allclose(got, want, atol=1e-6)
    np.testing.assert_allclose(got_evaluation, evaluation, rtol=1e-5)
    np.testing.assert_allclose(got_predictions, predictions, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("strategy_name", ["default", "one_device", "mirrored", "central_storage"])
def test_minus_one_reads_a_dataset_creator_once_an_epoch(one_device, strategy_name):
    # The creator starts a finite pipeline again when it ends: with -1 it never ended.
    first, losses, weights, _, predictions = one_device
    strategy = STRATEGIES[strategy_name]()

    def dataset_fn(input_context):
        rows = input_context.get_per_replica_batch_size(8)
        return [(X[i : i + rows], Y[i : i + rows]) for i in range(0, 32, rows)]

    model = _model(strategy, first)
    creator = kd.experimental.DatasetCreator(dataset_fn)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # Keras: an input of unknown length
        history = model.fit(creator, steps_per_epoch=-1, epochs=2, verbose=0)
        x_only = kd.experimental.DatasetCreator(lambda context: [x for x, _ in dataset_fn(context)])
        got_predictions = model.predict(x_only, steps=-1, verbose=0)
    np.testing.assert_allclose(history.history["loss"], losses, rtol=1e-5)
    for got, want in zip(model.get_weights(), weights):
        np.testing.assert_allclose(got, want, atol=1e-6)
    np.testing.assert_allclose(got_predictions, predictions, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("strategy_name", list(STRATEGIES))
def test_an_infinite_dataset_without_steps_is_refused(one_device, strategy_name):
    strategy = STRATEGIES[strategy_name]()
    model = _model(strategy, one_device[0])
    endless = {
        "tf.data stand-in": _EndlessTFStandIn(),
        "grain": grain.MapDataset.source([(X[i], Y[i]) for i in range(32)]).batch(8).repeat(),
    }
    assert len(endless["grain"]) == sys.maxsize  # how Grain says it never ends
    for kind, dataset in endless.items():
        distributed = strategy.experimental_distribute_dataset(dataset)
        with pytest.raises(ValueError, match=r"infinite dataset.*steps_per_epoch=None") as raised:
            model.fit(distributed, epochs=1, verbose=0)
        assert "Received: x=a distributed dataset of" in str(raised.value), kind
        with pytest.raises(ValueError, match=r"pass `steps`.*Received: x=.*steps=None"):
            model.evaluate(distributed, verbose=0)
        with pytest.raises(ValueError, match=r"pass `steps`"):
            model.predict(strategy.experimental_distribute_dataset(dataset), verbose=0)
        with pytest.raises(ValueError, match=r"Received: validation_data=.*validation_steps=None"):
            model.fit(X, Y, batch_size=8, epochs=1, validation_data=distributed, verbose=0)
    assert int(model.optimizer.iterations.numpy()) == 0  # refused before any step
    # With its steps it runs, as one device does on the same batches.
    history = model.fit(
        strategy.experimental_distribute_dataset(_EndlessTFStandIn()),
        steps_per_epoch=4,
        epochs=2,
        verbose=0,
    )
    np.testing.assert_allclose(history.history["loss"], one_device[1], rtol=1e-5)


@pytest.mark.parametrize("strategy_name", ["mirrored", "one_device"])
def test_an_infinite_dataset_is_refused_under_a_strategy_even_undistributed(
    one_device, strategy_name
):
    model = _model(STRATEGIES[strategy_name](), one_device[0])
    with pytest.raises(ValueError, match=r"Received: x=_EndlessTFStandIn of infinite cardinality"):
        model.fit(_EndlessTFStandIn(), epochs=1, verbose=0)


def test_a_distributed_dataset_of_unknown_length_warns_and_reads_to_its_end(one_device):
    first, losses, weights, _, _ = one_device
    strategy = kd.MirroredStrategy(cpus(2))
    model = _model(strategy, first)
    with pytest.warns(UserWarning, match=r"unknown length, read until it ends"):
        history = model.fit(
            strategy.experimental_distribute_dataset(_UnknownLength()), epochs=2, verbose=0
        )
    np.testing.assert_allclose(history.history["loss"], losses, rtol=1e-5)
    for got, want in zip(model.get_weights(), weights):
        np.testing.assert_allclose(got, want, atol=1e-6)


# ------------------------------------------------------------ with TensorFlow
@pytest.mark.parametrize("strategy_name", ["default", "one_device", "mirrored"])
def test_tf_data_minus_one_and_repeat_with_tensorflow(one_device, strategy_name):
    tf = pytest.importorskip("tensorflow")
    first, losses, weights, _, _ = one_device
    strategy = STRATEGIES[strategy_name]()
    dataset = tf.data.Dataset.from_tensor_slices((X, Y)).batch(8)
    model = _model(strategy, first)
    history = model.fit(dataset, steps_per_epoch=-1, epochs=2, verbose=0)
    np.testing.assert_allclose(history.history["loss"], losses, rtol=1e-5)
    for got, want in zip(model.get_weights(), weights):
        np.testing.assert_allclose(got, want, atol=1e-6)
    repeated = strategy.experimental_distribute_dataset(dataset.repeat())
    with pytest.raises(ValueError, match=r"_RepeatDataset of infinite cardinality"):
        model.fit(repeated, epochs=1, verbose=0)
