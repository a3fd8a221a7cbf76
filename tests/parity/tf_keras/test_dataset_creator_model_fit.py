"""tf-keras's ``dataset_creator_model_fit_test.py`` (and its ``_test_base.py``).

``DatasetCreator`` -> ``kd.experimental.DatasetCreator``: its ``dataset_fn`` returns
batches (``from_tensor_slices(...).shuffle(10).repeat().batch(2)`` -> the rows
reshuffled at each pass, endless); ``tf.random.uniform`` -> seeded NumPy or
``keras.random`` (the tensor-data tests) values. Each replica takes one element a step,
as with tf-keras's ``distribute_datasets_from_function``.
"""

import re

import keras
import numpy as np
import pytest

import keras_dist as kd

from ._strategies import ALL
from ._strategies import params

STRATEGIES = params(ALL, ci=[])  # the CI run keeps CI_STRATEGIES's tests
CI_STRATEGIES = params(ALL, ci=["mirrored2"])
NO_STEPS = re.escape(
    "When using a `tf.keras.utils.experimental.DatasetCreator`, "
    "`steps_per_epoch`, `validation_steps`, `steps`, or "
    "`pss_evaluation_shards` argument must be provided in "
    "`Model.fit`, `Model.evaluate`, or `Model.predict`."
)
PREDICT_X = np.array([[1.0], [2.0], [3.0], [1.0], [5.0], [1.0]], "float32")


def _batches(x, y=None, batch_size=2, shuffle=True, repeat=True, seed=0):
    """``from_tensor_slices((x, y))[.shuffle(10)][.repeat()].batch(batch_size)``: with
    ``repeat``, a batch may span two passes, as there."""
    rng = np.random.default_rng(seed)

    def rows():
        while True:
            yield from rng.permutation(len(x)) if shuffle else range(len(x))
            if not repeat:
                return

    stream = rows()
    while True:
        batch = [row for _, row in zip(range(batch_size), stream)]
        if not batch:
            return
        yield x[batch] if y is None else (x[batch], y[batch])


def _uniform(*shape, seed=0):
    return np.random.default_rng(seed).uniform(size=shape).astype("float32")


def _dataset_fn(input_context):
    del input_context
    return _batches(_uniform(10, 10), _uniform(10, seed=1))


def _lookup_dataset_fn(vocabulary_file):
    tf = pytest.importorskip("tensorflow")  # Keras 3's StringLookup runs on TensorFlow
    del tf

    def dataset_fn(input_context):
        del input_context
        lookup_layer = keras.layers.StringLookup(num_oov_indices=1, vocabulary=vocabulary_file)
        x = np.array([["earth", "wind", "and", "fire"], ["fire", "and", "earth", "michigan"]])
        y = np.array([0, 1])
        for x_batch, y_batch in _batches(x, y):  # ``.map(lambda x, y: (lookup(x), y))``
            yield np.asarray(lookup_layer(x_batch)), y_batch

    return dataset_fn


class ResultAssertingCallback(keras.callbacks.Callback):
    """Asserts the epochs increase and the logs hold a float loss."""

    def __init__(self):
        super().__init__()
        self._prev_epoch = -1

    def on_epoch_end(self, epoch, logs=None):
        if epoch <= self._prev_epoch:
            raise RuntimeError("Epoch is supposed to be larger than previous.")
        self._prev_epoch = epoch
        loss = logs.get("loss", None)
        if loss is None or not isinstance(loss, (float, np.floating)):
            raise RuntimeError("loss is supposed to be in the logs and float.")


def _model_compile(strategy, steps_per_execution=1, with_normalization_layer=False):
    with strategy.scope():
        model = keras.Sequential([keras.layers.Dense(10)])
        if with_normalization_layer:
            model.add(keras.layers.BatchNormalization(axis=-1, momentum=0.8))
        model.add(keras.layers.Dense(1, activation="sigmoid"))
        accuracy = keras.metrics.Accuracy()
        # tf-keras's legacy SGD, made outside the scope, made its variables at its first
        # step; Keras 3's makes them now, so in the scope (keras_dist says so otherwise).
        optimizer = keras.optimizers.SGD()
    model.compile(optimizer, loss="binary_crossentropy", metrics=[accuracy],
                  steps_per_execution=steps_per_execution)  # fmt: skip
    return model, accuracy, [ResultAssertingCallback()]


def _model_fit(strategy, steps_per_execution=1, validation_data=None, x=None, y=None,
               batch_size=None, steps_per_epoch=10, with_normalization_layer=False,
               dataset_fn=_dataset_fn):  # fmt: skip
    model, _, callbacks = _model_compile(strategy, steps_per_execution, with_normalization_layer)
    if x is None:
        x = kd.experimental.DatasetCreator(dataset_fn)
    if validation_data is None:
        validation_data = kd.experimental.DatasetCreator(dataset_fn)
    model.fit(x, y, shuffle=True, batch_size=batch_size, epochs=10,
              steps_per_epoch=steps_per_epoch, callbacks=callbacks,
              validation_data=validation_data, validation_steps=steps_per_epoch,
              verbose=0)  # fmt: skip
    return model


def _model_evaluate(strategy, steps_per_execution=1, x=None, y=None, batch_size=None, steps=10,
                    with_normalization_layer=False):  # fmt: skip
    model, accuracy, callbacks = _model_compile(
        strategy, steps_per_execution, with_normalization_layer
    )

    def dataset_fn(input_context):
        del input_context
        return _batches(_uniform(10, 10), _uniform(10, 1, seed=1), batch_size=8)

    if x is None:
        x = kd.experimental.DatasetCreator(dataset_fn)
    model.evaluate(x=x, y=y, steps=steps, callbacks=callbacks, batch_size=batch_size, verbose=0)
    return accuracy


def _model_predict(strategy, model=None, steps_per_execution=1, test_data=None, steps=10,
                   with_normalization_layer=False):  # fmt: skip
    callbacks = []
    if model is None:
        model, _, callbacks = _model_compile(
            strategy, steps_per_execution, with_normalization_layer=with_normalization_layer
        )
    if test_data is None:
        # ``from_tensor_slices(x).repeat().batch(2)``, read for ``steps`` steps.
        repeated = np.concatenate([PREDICT_X] * steps)
        test_data = strategy.experimental_make_numpy_dataset(repeated).batch(2)
    predictions = model.predict(x=test_data, steps=steps, callbacks=callbacks, verbose=0)
    return model, np.around(predictions, 4)


def _assert_repeating_predictions(predictions):
    # The first, fourth and last inputs are the same: so are their predictions.
    assert all(predictions[0] == predictions[i] for i in [0, 3, 5])
    assert not all(predictions[0] == predictions[i] for i in [0, 1, 2, 4])


@pytest.mark.parametrize("strategy", CI_STRATEGIES, indirect=True)
def test_model_fit(strategy):
    model = _model_fit(strategy)
    assert int(np.asarray(model.optimizer.iterations)) == 100


@pytest.mark.parametrize("strategy", CI_STRATEGIES, indirect=True)
def test_model_fit_with_steps_per_epoch_negative_one(strategy):
    def dataset_fn(input_context):
        del input_context
        return _batches(_uniform(10, 10), _uniform(10, seed=1), repeat=False)

    _model_fit(strategy, steps_per_epoch=-1, x=kd.experimental.DatasetCreator(dataset_fn),
               validation_data=kd.experimental.DatasetCreator(dataset_fn))  # fmt: skip


@pytest.mark.parametrize("strategy", STRATEGIES, indirect=True)
def test_model_fit_with_numpy_data(strategy):
    x, y = np.random.rand(100, 10), np.random.rand(100, 1)
    model = _model_fit(strategy, x=x, y=y, batch_size=1, validation_data=(x, y))
    assert int(np.asarray(model.optimizer.iterations)) == 100


@pytest.mark.parametrize("strategy", STRATEGIES, indirect=True)
def test_model_fit_with_tensor_data(strategy):
    x = keras.random.uniform((100, 10), seed=0)
    y = keras.random.uniform((100,), seed=1)
    model = _model_fit(strategy, x=x, y=y, batch_size=1, validation_data=(x, y))
    assert int(np.asarray(model.optimizer.iterations)) == 100


@pytest.mark.parametrize("strategy", STRATEGIES, indirect=True)
def test_model_fit_with_lookup_layer(strategy, tmp_path):
    vocabulary_file = tmp_path / "vocab"
    vocabulary_file.write_text("\n".join(["earth", "wind", "and", "fire"]))
    model = _model_fit(strategy, dataset_fn=_lookup_dataset_fn(str(vocabulary_file)))
    assert int(np.asarray(model.optimizer.iterations)) == 100


@pytest.mark.parametrize("strategy", STRATEGIES, indirect=True)
def test_model_fit_with_normalization_layer(strategy):
    model = _model_fit(strategy, with_normalization_layer=True)
    assert int(np.asarray(model.optimizer.iterations)) == 100


@pytest.mark.parametrize("strategy", STRATEGIES, indirect=True)
def test_model_fit_with_steps_per_execution(strategy):
    model = _model_fit(strategy, steps_per_execution=10)
    assert int(np.asarray(model.optimizer.iterations)) == 100


@pytest.mark.parametrize("strategy", CI_STRATEGIES, indirect=True)
def test_model_fit_with_no_steps_per_epoch(strategy):
    with pytest.raises(ValueError, match=NO_STEPS):
        _model_fit(strategy, steps_per_epoch=None)


@pytest.mark.parametrize("strategy", STRATEGIES, indirect=True)
def test_model_evaluate(strategy):
    assert float(_model_evaluate(strategy).result()) >= 0.0


@pytest.mark.parametrize("strategy", STRATEGIES, indirect=True)
def test_model_evaluate_with_numpy_data(strategy):
    x, y = np.random.rand(100, 10), np.random.rand(100, 1)
    assert float(_model_evaluate(strategy, x=x, y=y, batch_size=1).result()) >= 0.0


@pytest.mark.parametrize("strategy", STRATEGIES, indirect=True)
def test_model_evaluate_with_tensor_data(strategy):
    x = keras.random.uniform((100, 10), seed=0)
    y = keras.random.uniform((100,), seed=1)
    assert float(_model_evaluate(strategy, x=x, y=y, batch_size=1).result()) >= 0.0


@pytest.mark.parametrize("strategy", STRATEGIES, indirect=True)
def test_model_evaluate_with_normalization_layer(strategy):
    accuracy = _model_evaluate(strategy, with_normalization_layer=True)
    assert float(accuracy.result()) >= 0.0


@pytest.mark.parametrize("strategy", STRATEGIES, indirect=True)
def test_model_evaluate_with_steps_per_execution(strategy):
    assert float(_model_evaluate(strategy, steps_per_execution=10).result()) >= 0.0


@pytest.mark.parametrize("strategy", STRATEGIES, indirect=True)
def test_model_evaluate_with_no_steps_per_epoch(strategy):
    with pytest.raises(ValueError, match=NO_STEPS):
        _model_evaluate(strategy, steps=None)


@pytest.mark.parametrize("strategy", STRATEGIES, indirect=True)
def test_model_predict(strategy):
    _, predictions = _model_predict(strategy, steps=3)
    _assert_repeating_predictions(predictions)


@pytest.mark.parametrize("strategy", STRATEGIES, indirect=True)
def test_model_predict_with_numpy_data(strategy):
    x = PREDICT_X.astype("float64")
    _, predictions = _model_predict(strategy, test_data=x)
    _assert_repeating_predictions(predictions)


@pytest.mark.parametrize("strategy", STRATEGIES, indirect=True)
def test_model_predict_with_tensor_data(strategy):
    x = keras.ops.convert_to_tensor(PREDICT_X)
    _, predictions = _model_predict(strategy, test_data=x)
    _assert_repeating_predictions(predictions)


@pytest.mark.parametrize("strategy", STRATEGIES, indirect=True)
def test_model_predict_with_normalization_layer(strategy):
    _, predictions = _model_predict(strategy, with_normalization_layer=True, steps=3)
    _assert_repeating_predictions(predictions)


@pytest.mark.parametrize("strategy", STRATEGIES, indirect=True)
def test_model_predict_with_steps_per_execution(strategy):
    _, predictions = _model_predict(strategy, steps_per_execution=3, steps=3)
    _assert_repeating_predictions(predictions)


@pytest.mark.parametrize("strategy", STRATEGIES, indirect=True)
def test_model_fit_and_predict(strategy):
    def fit_dataset_fn(input_context):
        del input_context
        return _batches(_uniform(10, 1), _uniform(10, seed=1))

    x = kd.experimental.DatasetCreator(fit_dataset_fn)
    validation_data = kd.experimental.DatasetCreator(fit_dataset_fn)
    model = _model_fit(strategy, x=x, validation_data=validation_data)
    _, predictions = _model_predict(strategy, model, steps=3)
    _assert_repeating_predictions(predictions)


@pytest.mark.parametrize("strategy", CI_STRATEGIES, indirect=True)
def test_model_predict_with_dataset_creator(strategy):
    def _dataset_fn(input_context):
        del input_context
        return _batches(PREDICT_X, shuffle=False)  # ``.repeat().batch(2)``

    _, predictions = _model_predict(
        strategy, steps=3, test_data=kd.experimental.DatasetCreator(_dataset_fn)
    )
    _assert_repeating_predictions(predictions)
