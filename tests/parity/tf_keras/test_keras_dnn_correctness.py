"""tf-keras's ``keras_dnn_correctness_test.py``: a small DNN trains to one device's numbers."""

import keras
import numpy as np
import pytest

from . import _correctness
from ._strategies import ALL
from ._strategies import params

FULL = pytest.mark.tf_keras_full

# The CI run keeps two of the four input configurations (and the Sequential model);
# ``python -m pytest tests/parity/tf_keras`` runs them all.
INPUT_CONFIGS = [
    pytest.param(True, True, id="numpy-validation", marks=FULL),
    pytest.param(True, False, id="numpy-evaluate"),
    pytest.param(False, True, id="dataset-validation"),
    pytest.param(False, False, id="dataset-evaluate", marks=FULL),
]
X_PREDICT = np.array([[1.0], [2.0], [3.0], [4.0]], dtype=np.float32)


def _rand(rows):
    return np.random.rand(rows, 1).astype("float32")


class Dnn:
    """``TestDistributionStrategyDnnCorrectness``'s model and data."""

    @staticmethod
    def get_model(initial_weights=None, strategy=None):
        with _correctness.scope(strategy):
            # A few non-linear layers to make it non-trivial.
            model = keras.Sequential(
                [
                    keras.Input((1,)),
                    keras.layers.Dense(10, activation="relu"),
                    keras.layers.Dense(
                        10, activation="relu", kernel_regularizer=keras.regularizers.l2(1e-4)
                    ),
                    keras.layers.Dense(10, activation="relu"),
                    keras.layers.Dense(1),
                ]
            )
            if initial_weights:
                model.set_weights(initial_weights)
            model.compile(loss="mse", optimizer=keras.optimizers.SGD(0.05), metrics=["mse"])
            return model

    @staticmethod
    def data():
        x_train = _rand(9984)
        return x_train, 3 * x_train, X_PREDICT

    @staticmethod
    def data_with_partial_last_batch():
        x_train, x_eval = _rand(10000), _rand(10000)
        return x_train, 3 * x_train, x_eval, 3 * x_eval, X_PREDICT

    @staticmethod
    def data_with_partial_last_batch_eval():
        x_train, x_eval = _rand(9984), _rand(10000)
        return x_train, 3 * x_train, x_eval, 3 * x_eval, X_PREDICT


class SubclassedModel(keras.Model):
    def __init__(self, initial_weights):
        super().__init__()
        self.dense1 = keras.layers.Dense(10, activation="relu")
        self.dense2 = keras.layers.Dense(
            10, activation="relu", kernel_regularizer=keras.regularizers.l2(1e-4)
        )
        self.dense3 = keras.layers.Dense(10, activation="relu")
        self.dense4 = keras.layers.Dense(1)
        # tf-keras's ``self.build(input_shapes)``: Keras 3 creates a subclassed model's
        # sublayers' weights when the model is first called.
        self(np.zeros((1, 1), "float32"))
        if initial_weights:
            self.set_weights(initial_weights)

    def call(self, inputs):
        return self.dense4(self.dense3(self.dense2(self.dense1(inputs))))


class SubclassedDnn(Dnn):
    """``TestDistributionStrategyDnnCorrectnessWithSubclassedModel``."""

    @staticmethod
    def get_model(initial_weights=None, strategy=None):
        with _correctness.scope(strategy):
            model = SubclassedModel(initial_weights)
            model.compile(loss="mse", optimizer=keras.optimizers.SGD(0.05), metrics=["mse"])
            return model


MODELS = [
    pytest.param(Dnn, id="sequential"),
    pytest.param(SubclassedDnn, id="subclassed", marks=FULL),
]


# tf-keras runs the subclassed model in eager mode on every strategy (graph mode
# expects an error instead, see not_applicable.py).
@pytest.mark.parametrize("test_model", MODELS)
@pytest.mark.parametrize("use_numpy, use_validation_data", INPUT_CONFIGS)
@pytest.mark.parametrize("strategy", params(ALL, ci=["mirrored2"]), indirect=True)
def test_dnn_correctness(strategy, use_numpy, use_validation_data, test_model):
    _correctness.run_correctness_test(test_model, strategy, use_numpy, use_validation_data)


# tf-keras runs this on TPUs and multi-worker mirrored only; the local strategies read
# a partial last evaluation batch the same way.
@pytest.mark.parametrize("use_numpy, use_validation_data", INPUT_CONFIGS)
@pytest.mark.parametrize("strategy", params(ALL, ci=["central_storage2"]), indirect=True)
def test_dnn_correctness_with_partial_last_batch_eval(strategy, use_numpy, use_validation_data):
    _correctness.run_correctness_test(
        Dnn, strategy, use_numpy, use_validation_data, partial_last_batch="eval"
    )


@pytest.mark.parametrize("use_numpy, use_validation_data", INPUT_CONFIGS)
@pytest.mark.parametrize("strategy", params(ALL, ci=["mirrored2"]), indirect=True)
def test_dnn_correctness_with_partial_last_batch(strategy, use_numpy, use_validation_data):
    _correctness.run_correctness_test(
        Dnn,
        strategy,
        use_numpy,
        use_validation_data,
        partial_last_batch="train_and_eval",
        training_epochs=1,
    )


# tf-keras runs it in graph mode only; the callback's assignment to the learning rate
# is the same in eager mode.
@pytest.mark.parametrize("test_model", MODELS)
@pytest.mark.parametrize("strategy", params(ALL, ci=["mirrored2"]), indirect=True)
def test_dnn_with_dynamic_learning_rate(strategy, test_model):
    _correctness.run_dynamic_lr_test(test_model, strategy)


@pytest.mark.parametrize("strategy", params(ALL), indirect=True)
def test_simple_dnn_metric_correctness(strategy):
    # TestDistributionStrategyDnnMetricCorrectness.
    np.random.seed(_correctness.RANDOM_SEED)
    x_train = np.random.randint(0, 2, (10000, 1)).astype("float32")
    with strategy.scope():
        model = keras.Sequential(
            [keras.Input((1,)), keras.layers.Dense(1, kernel_initializer="ones")]
        )
        model.compile(
            loss="mse",
            optimizer=keras.optimizers.SGD(0.05),
            metrics=[keras.metrics.BinaryAccuracy()],
        )
    dataset = strategy.experimental_make_numpy_dataset((x_train, x_train)).batch(64)
    history = model.fit(x=dataset, epochs=2, steps_per_epoch=10, verbose=0)
    assert history.history["binary_accuracy"] == [1.0, 1.0]


@pytest.mark.parametrize("strategy", params(ALL), indirect=True)
def test_identity_model_metric_eval_correctness(strategy):
    # TestDistributionStrategyDnnMetricEvalCorrectness: stateful and stateless metrics.
    with strategy.scope():
        model = keras.Sequential(
            [
                keras.Input((4,)),
                keras.layers.Dense(3, activation="relu", kernel_initializer="ones"),
                keras.layers.Dense(1, activation="sigmoid", kernel_initializer="ones"),
            ]
        )
        model.compile(
            loss="mae",
            metrics=["accuracy", keras.metrics.BinaryAccuracy()],
            optimizer=keras.optimizers.SGD(0.001),
        )
    x = np.ones((100, 4), "float32")
    for label, expected in ((1.0, 1.0), (0.0, 0.0)):
        y = np.full((100, 1), label, "float32")
        dataset = strategy.experimental_make_numpy_dataset((x, y)).batch(4)
        outs = model.evaluate(dataset, steps=10, verbose=0)
        assert outs[1] == expected
        assert outs[2] == expected
