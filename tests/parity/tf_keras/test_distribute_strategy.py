"""tf-keras's ``distribute_strategy_test.py``: fit, evaluate and predict under a strategy.

``tf.data`` -> ``strategy.experimental_make_numpy_dataset(arrays).batch(n)`` (read in
order, as ``fit`` reads a ``tf.data`` dataset); ``.repeat(n)`` -> the arrays tiled ``n``
times; ``.repeat()`` read for a given number of steps -> enough copies for them. Legacy
optimizers (``gradient_descent_keras.SGD``, ``tf.compat.v1.train.*``) -> Keras 3's.
tf-keras's TPU-only partial-batch tests run over the local strategies.
"""

import contextlib
import sys

import keras
import numpy as np
import pytest

import keras_dist as kd

from . import _correctness
from ._strategies import ALL
from ._strategies import MINUS_DEFAULT
from ._strategies import params

FULL = pytest.mark.tf_keras_full
RANDOM_SEED = 1337
# The CI run keeps one parametrization of a few tests (the loss reductions, sample
# weights, partial batches, steps, regularizers, a captured strategy); ``ci=FULL_ONLY``
# leaves a test to ``python -m pytest tests/parity/tf_keras``.
FULL_ONLY = []


def _dataset(strategy, arrays, batch_size, repeat=None, drop_remainder=False):
    """``from_tensor_slices(arrays)[.repeat(repeat)].batch(batch_size)``."""
    if repeat:
        arrays = keras.tree.map_structure(lambda a: np.concatenate([a] * repeat), arrays)
    numpy_dataset = (strategy or kd.get_strategy()).experimental_make_numpy_dataset(arrays)
    return numpy_dataset.batch(batch_size, drop_remainder=drop_remainder)


class _Repeated:
    """``dataset.repeat()``: the batches again and again, endless as Grain's (its length)."""

    def __init__(self, batches):
        self._batches = batches

    def __len__(self):
        return sys.maxsize

    def __iter__(self):
        while True:
            yield from self._batches


def get_model():
    x = keras.Input((3,), name="input")
    return keras.Model(x, keras.layers.Dense(4, name="dense")(x))


def get_sample_weights_model():
    x = keras.Input((1,), name="input")
    y = keras.layers.Dense(1, kernel_initializer="ones", bias_initializer="zeros", name="dense")(x)
    return keras.Model(x, y)


def get_dataset(strategy):
    inputs, targets = np.zeros((10, 3), np.float32), np.zeros((10, 4), np.float32)
    return _dataset(strategy, (inputs, targets), 10, repeat=100)


def get_predict_dataset(strategy):
    return _dataset(strategy, np.zeros((10, 3), np.float32), 10, repeat=100)


def multi_input_output_model():
    a = keras.Input((3,), name="input_a")
    b = keras.Input((5,), name="input_b")
    c = keras.layers.Dense(7, name="dense_1")(a)
    d = keras.layers.Dense(7, name="dense_2")(b)
    e = keras.layers.Dropout(0.5, name="dropout")(c)
    return keras.Model([a, b], [d, e])


def simple_sequential_model():
    return keras.Sequential(
        [
            keras.Input((10,)),
            keras.layers.Dense(16, activation="relu"),
            keras.layers.Dropout(0.1),
            keras.layers.Dense(2, activation="softmax"),
        ]
    )


def simple_multi_inputs_multi_outputs_model():
    input_a = keras.Input((16,), name="input_a")
    input_b = keras.Input((16,), name="input_b")
    merged = keras.layers.concatenate([input_a, input_b], name="merge")
    output_c = keras.layers.Dense(3, activation="softmax", name="dense_2")(merged)
    output_d = keras.layers.Dense(2, activation="softmax", name="dense_3")(merged)
    return keras.Model([input_a, input_b], [output_c, output_d])


def _sgd_model(strategy, make=get_model, metrics=("mae", "categorical_accuracy")):
    with strategy.scope():
        model = make()
        model.compile(keras.optimizers.SGD(0.001), "mse", metrics=list(metrics))
    return model


def _assert_history_close(actual, expected, tolerance):
    assert sorted(actual) == sorted(expected)
    for key in expected:
        np.testing.assert_allclose(actual[key], expected[key], atol=tolerance, rtol=tolerance,
                                   err_msg=key)  # fmt: skip


# --- TestDistributionStrategyWithNumpyArrays -------------------------------------------


@pytest.mark.parametrize("strategy", params(ALL, ci=FULL_ONLY), indirect=True)
def test_calling_model_with_numpy_arrays(strategy):
    model = _sgd_model(strategy, metrics=["mae"])
    inputs, targets = np.zeros((64, 3), np.float32), np.zeros((64, 4), np.float32)
    model.fit(inputs, targets, epochs=1, batch_size=2, verbose=0,
              validation_data=(inputs, targets))  # fmt: skip
    model.evaluate(inputs, targets, verbose=0)
    model.evaluate(inputs, targets, batch_size=8, verbose=0)
    model.predict(inputs, verbose=0)
    model.predict(inputs, batch_size=8, verbose=0)


@contextlib.contextmanager
def _policy_scope(name):
    """tf-keras's ``policy.policy_scope``: the global dtype policy, then the previous one."""
    previous = keras.mixed_precision.global_policy()
    keras.mixed_precision.set_global_policy(name)
    try:
        yield
    finally:
        keras.mixed_precision.set_global_policy(previous)


# tf-keras skips CentralStorageStrategy here (b/152097775); keras_dist runs it.
@pytest.mark.parametrize("strategy", params(ALL, ci=FULL_ONLY), indirect=True)
def test_calling_model_with_mixed_precision(strategy):
    with strategy.scope(), _policy_scope("mixed_float16"):
        x = keras.Input((3,), name="input")
        y = keras.layers.Dense(4, name="dense")(x)
        y = keras.layers.Activation("softmax", dtype="float32")(y)
        model = keras.Model(x, y)
        model.compile(keras.optimizers.SGD(0.001), "mse", metrics=["mae"])
        inputs, targets = np.zeros((64, 3), "float32"), np.zeros((64, 4), "float32")
        model.fit(inputs, targets, epochs=1, batch_size=2, verbose=0,
                  validation_data=(inputs, targets))  # fmt: skip
        model.evaluate(inputs, targets, verbose=0)
        model.evaluate(inputs, targets, batch_size=8, verbose=0)
        model.predict(inputs, verbose=0)
        model.predict(inputs, batch_size=8, verbose=0)


@pytest.mark.parametrize("strategy", params(ALL, ci=FULL_ONLY), indirect=True)
def test_operator_overload_mixed_precision(strategy):
    # Adding a mixed-precision variable (the LHS of ``+``) to a tensor used to give it a
    # None gradient on TPUs.
    class MyLayer(keras.layers.Layer):
        def build(self, _):
            self.v1 = self.add_weight(name="v", shape=())
            self.v2 = self.add_weight(name="v", shape=())

        def call(self, inp):
            inp += self.v1
            return self.v2 + inp

    with strategy.scope():
        layer = MyLayer(dtype="mixed_float16")
        layer.build(())

        @kd.function
        def run_fn():
            x = np.array([1.0])
            _, grads = kd.value_and_grad(lambda: layer(x), [layer.v1, layer.v2])()
            return grads

        grad_v1, grad_v2 = strategy.run(run_fn)
        assert grad_v1 is not None
        assert grad_v2 is not None


# test_optimizer_in_cross_replica_context_raises_error: not_applicable.py.


@pytest.mark.parametrize("strategy", params(ALL, ci=FULL_ONLY), indirect=True)
def test_calling_model_with_nested_numpy_arrays(strategy):
    with strategy.scope():
        model = multi_input_output_model()
        model.compile(keras.optimizers.SGD(learning_rate=0.001), "mse")
    inputs = [np.random.random((64, 3)).astype("float32"),
              np.random.random((64, 5)).astype("float32")]  # fmt: skip
    targets = [np.random.random((64, 7)).astype("float32"),
               np.random.random((64, 7)).astype("float32")]  # fmt: skip
    model.fit(inputs, targets, epochs=1, batch_size=8, verbose=0)
    model.evaluate(inputs, targets, verbose=0)
    model.evaluate(inputs, targets, batch_size=8, verbose=0)
    model.predict(inputs, verbose=0)
    model.predict(inputs, batch_size=8, verbose=0)


SAMPLE_INPUTS = np.array([[0], [1], [2], [3]], np.float32)
SAMPLE_TARGETS = np.array([[2], [4], [6], [8]], np.float32)
SAMPLE_WEIGHTS = np.array([0.25, 0.5, 0.75, 1], np.float32)


def _sample_weights_model(strategy):
    with strategy.scope():
        model = get_sample_weights_model()
        model.compile(keras.optimizers.RMSprop(learning_rate=0.001), "mse")
    return model


@pytest.mark.parametrize("strategy", params(ALL, ci=["mirrored2"]), indirect=True)
def test_numpy_with_sample_weights(strategy):
    model = _sample_weights_model(strategy)
    result = model.evaluate(SAMPLE_INPUTS, SAMPLE_TARGETS, batch_size=2,
                            sample_weight=SAMPLE_WEIGHTS, verbose=0)  # fmt: skip
    # batch_1 = (((2-0)^2) * 0.25 + ((4-1)^2) * 0.5) / 2 = 5.5 / 2 = 2.75
    # batch_2 = (((6-2)^2 * 0.75) + ((8-3)^2 * 1)) / 2 = 37 / 2 = 18.5
    # final result = (batch_1 + batch_2) / 2 = 10.625.
    np.testing.assert_allclose(result, 10.625, rtol=1e-6, atol=1e-6)
    # Without sample weights: (13 / 2 + 41 / 2) / 2 = 13.5.
    result = model.evaluate(SAMPLE_INPUTS, SAMPLE_TARGETS, batch_size=2, verbose=0)
    np.testing.assert_allclose(result, 13.5, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("strategy", params(ALL, ci=FULL_ONLY), indirect=True)
def test_flatten_predict_outputs(strategy):
    with strategy.scope():
        model = multi_input_output_model()
        model.compile(keras.optimizers.SGD(learning_rate=0.001), "mse")
    # 6 input samples, of 3 and 5 features.
    inputs = [np.random.random((6, 3)).astype("float32"),
              np.random.random((6, 5)).astype("float32")]  # fmt: skip
    outs = model.predict(inputs, verbose=0)
    # One element per model output, each over all 6 samples.
    assert len(outs) == 2
    assert list(outs[0].shape) == [6, 7]
    assert list(outs[1].shape) == [6, 7]


def _model_and_cpu_model(strategy, make, metrics=None):
    with strategy.scope():
        model_with_ds_strategy = make()
        model_with_ds_strategy.compile(keras.optimizers.SGD(0.001), "mse", metrics=metrics)
    cpu_model = make()
    cpu_model.compile(keras.optimizers.SGD(0.001), "mse", metrics=metrics)
    cpu_model.set_weights(model_with_ds_strategy.get_weights())
    return model_with_ds_strategy, cpu_model


PARTIAL_METRICS = ["mae", keras.metrics.CategoricalAccuracy]


# tf-keras runs the partial-batch tests on TPUs in graph mode only; the local strategies
# split a partial last batch between their replicas.
@pytest.mark.parametrize("batch_size", [4, 6])
@pytest.mark.parametrize("strategy", params(ALL, ci=["mirrored2"]), indirect=True)
def test_evaluate_with_partial_batch(strategy, batch_size):
    metrics = lambda: ["mae", keras.metrics.CategoricalAccuracy()]  # noqa: E731
    with strategy.scope():
        model_with_ds_strategy = get_model()
        model_with_ds_strategy.compile(keras.optimizers.SGD(0.001), "mse", metrics=metrics())
    cpu_model = get_model()
    cpu_model.compile(keras.optimizers.SGD(0.001), "mse", metrics=metrics())
    x = np.random.random((10, 3)).astype("float32")
    y = np.random.random((10, 4)).astype("float32")
    # Without a strategy, the 10 samples in one batch. The loss is not compared: the last
    # partial batch's samples weigh more in it.
    cpu_model.set_weights(model_with_ds_strategy.get_weights())
    evaluate_ground_truth = cpu_model.evaluate(x, y, verbose=0)
    steps = int(np.ceil(10.0 / batch_size))
    np.testing.assert_allclose(
        model_with_ds_strategy.evaluate(x, y, batch_size=batch_size, steps=steps, verbose=0)[1:],
        evaluate_ground_truth[1:], atol=1e-5, rtol=1e-5,
    )  # fmt: skip
    # ``steps`` inferred with a final partial batch.
    np.testing.assert_allclose(
        model_with_ds_strategy.evaluate(x, y, batch_size=batch_size, verbose=0)[1:],
        evaluate_ground_truth[1:], atol=1e-5, rtol=1e-5,
    )  # fmt: skip


@pytest.mark.parametrize("strategy", params(ALL, ci=FULL_ONLY), indirect=True)
def test_predict_with_partial_batch(strategy):
    model_with_ds_strategy, cpu_model = _model_and_cpu_model(strategy, get_model)
    inputs = np.random.random((10, 3)).astype(np.float32)
    predict_ground_truth = cpu_model.predict(inputs, verbose=0)
    np.testing.assert_allclose(
        model_with_ds_strategy.predict(inputs, batch_size=4, steps=3, verbose=0),
        predict_ground_truth, atol=1e-5, rtol=1e-5,
    )  # fmt: skip
    np.testing.assert_allclose(
        model_with_ds_strategy.predict(inputs, batch_size=4, verbose=0),
        predict_ground_truth, atol=1e-5, rtol=1e-5,
    )  # fmt: skip


class _SumLoss(keras.layers.Layer):
    """``self.add_loss(tf.reduce_sum(inputs), inputs=True)``: a loss of the inputs."""

    def call(self, inputs):
        self.add_loss(keras.ops.sum(inputs))
        return inputs


@pytest.mark.parametrize("strategy", params(ALL, ci=FULL_ONLY), indirect=True)
def test_no_target_model(strategy):
    with strategy.scope():
        model = keras.Sequential(
            [keras.Input((10,)), keras.layers.Dense(16, activation="relu"), _SumLoss(),
             keras.layers.Dense(2, activation="softmax")]
        )  # fmt: skip
        model.compile(keras.optimizers.SGD(0.001))
        inputs = np.zeros((20, 10), np.float32)
        model.fit(inputs, epochs=1, steps_per_epoch=2, verbose=0)
        model.predict(inputs, steps=1, verbose=0)
        model.evaluate(inputs, steps=1, verbose=0)


def _multi_inputs_data():
    rng = np.random.RandomState(RANDOM_SEED)
    return {
        "input_a": rng.random_sample((200, 16)).astype("float32"),
        "input_b": rng.random_sample((200, 16)).astype("float32"),
    }


@pytest.mark.parametrize("strategy", params(ALL, ci=FULL_ONLY), indirect=True)
def test_predict_multi_output_model_with_partial_batch(strategy):
    model_with_ds_strategy, cpu_model = _model_and_cpu_model(
        strategy, simple_multi_inputs_multi_outputs_model
    )
    input_dict = _multi_inputs_data()
    # 200 samples in batches of 18: the last one is partial.
    _correctness.assert_all_close(
        model_with_ds_strategy.predict(input_dict, batch_size=18, steps=12, verbose=0),
        cpu_model.predict(input_dict, verbose=0), atol=1e-4, rtol=1e-4,
    )  # fmt: skip


@pytest.mark.parametrize("strategy", params(ALL, ci=FULL_ONLY), indirect=True)
def test_gradients_are_none(strategy):
    class DenseWithExtraWeight(keras.layers.Dense):
        def build(self, input_shape):
            # Gradients w.r.t. the extra weights are None.
            self.extra_weight_1 = self.add_weight(name="extra_weight_1", shape=(),
                                                  initializer="ones")  # fmt: skip
            super().build(input_shape)
            self.extra_weight_2 = self.add_weight(name="extra_weight_2", shape=(),
                                                  initializer="ones")  # fmt: skip

    with strategy.scope():
        model = keras.Sequential([keras.Input((4,)), DenseWithExtraWeight(4)])
        model.compile("adam", "mse")
    inputs = np.random.normal(size=(64, 4))
    targets = np.random.normal(size=(64, 4))
    old_kernel = model.get_weights()[1]
    model.fit(inputs, targets, verbose=0)
    new_kernel = model.get_weights()[1]
    assert not np.array_equal(old_kernel, new_kernel)


# --- TestDistributionStrategyWithDatasets ------------------------------------------------


@pytest.mark.parametrize("strategy", params(ALL, ci=FULL_ONLY), indirect=True)
def test_calling_model_on_same_dataset(strategy):
    model = _sgd_model(strategy)
    dataset = get_dataset(strategy)
    for _ in range(2):
        model.fit(dataset, epochs=1, steps_per_epoch=2, verbose=0, validation_data=dataset,
                  validation_steps=2)  # fmt: skip
    model.predict(get_predict_dataset(strategy), steps=2, verbose=0)


@pytest.mark.parametrize("strategy", params(ALL, ci=FULL_ONLY), indirect=True)
def test_model_interleaved_eval_same_as_direct_eval(strategy):
    user_controlled_model = _sgd_model(strategy)
    with strategy.scope():
        interleaved_model = get_model()
        interleaved_model.set_weights(user_controlled_model.get_weights())
        interleaved_model.compile(keras.optimizers.SGD(0.001), loss="mse",
                                  metrics=["mae", keras.metrics.CategoricalAccuracy()])  # fmt: skip
    dataset = get_dataset(strategy)
    interleaved_output = interleaved_model.fit(
        dataset, epochs=2, steps_per_epoch=2, verbose=0, validation_data=dataset,
        validation_steps=2, shuffle=False,
    )  # fmt: skip
    # The validation after each epoch, run by hand.
    user_controlled_output = []
    for _ in range(2):
        user_controlled_model.fit(dataset, epochs=1, steps_per_epoch=2, verbose=0,
                                  shuffle=False)  # fmt: skip
        user_controlled_output.append(user_controlled_model.evaluate(dataset, steps=2, verbose=0))
    history = interleaved_output.history
    assert history["val_loss"] == [x[0] for x in user_controlled_output]
    assert history["val_mae"] == [x[1] for x in user_controlled_output]
    assert history["val_categorical_accuracy"] == [x[2] for x in user_controlled_output]


@pytest.mark.parametrize("strategy", params(ALL, ci=FULL_ONLY), indirect=True)
def test_fit_with_tuple_and_dict_dataset_inputs(strategy):
    with strategy.scope():
        model = multi_input_output_model()
        model.compile(keras.optimizers.SGD(learning_rate=0.001), "mse",
                      metrics=["mae", keras.metrics.CategoricalAccuracy()])  # fmt: skip
    input_a_np = np.random.random((10, 3)).astype("float32")
    input_b_np = np.random.random((10, 5)).astype("float32")
    output_d_np = np.random.random((10, 7)).astype("float32")
    output_e_np = np.random.random((10, 7)).astype("float32")
    dataset_tuple = _dataset(
        strategy, ((input_a_np, input_b_np), (output_d_np, output_e_np)), 10, repeat=100
    )
    model.fit(dataset_tuple, epochs=1, steps_per_epoch=2, verbose=0)
    dataset_dict = _dataset(
        strategy,
        ({"input_a": input_a_np, "input_b": input_b_np}, (output_d_np, output_e_np)),
        10,
        repeat=100,
    )
    model.fit(dataset_dict, epochs=1, steps_per_epoch=2, verbose=0)


class _WeightedBceLoss(keras.layers.Layer):
    """tf-keras's ``Lambda(custom_loss)`` output given to ``model.add_loss``: Keras 3 adds
    a loss in a layer's ``call``."""

    def call(self, inputs):
        predict, label, weight = inputs
        # TF broadcast the label (one channel) over the prediction's two; Keras 3 asks
        # for equal shapes.
        bce = keras.losses.binary_crossentropy(label * keras.ops.ones_like(predict), predict)
        loss = keras.ops.mean(bce * weight)
        self.add_loss(loss)
        return loss


@pytest.mark.parametrize("strategy", params(ALL, ci=FULL_ONLY), indirect=True)
def test_fit_with_dictionary_in_the_dataset_b135161171(strategy):
    with strategy.scope():
        input_img = keras.Input([64, 64, 3], name="img")
        input_lbl = keras.Input([64, 64, 1], name="lbl")
        input_weight = keras.Input([64, 64], name="weight")
        predict = keras.layers.Conv2D(2, [1, 1], padding="same")(input_img)
        my_loss = _WeightedBceLoss(name="my_loss")([predict, input_lbl, input_weight])
        model = keras.Model(inputs=[input_img, input_lbl, input_weight],
                            outputs=[predict, my_loss])  # fmt: skip
        model.compile(optimizer="adam")
    fake_imgs = np.ones([50, 64, 64, 3], dtype=np.float32)
    fake_lbls = np.ones([50, 64, 64, 1], dtype=np.float32)
    fake_weights = np.ones([50, 64, 64], dtype=np.float32)
    # ``.map(lambda img, lbl, weight: ({"img": ..., "lbl": ..., "weight": ...},))``.
    inputs = {"img": fake_imgs, "lbl": fake_lbls, "weight": fake_weights}
    model.fit(_dataset(strategy, (inputs,), 10), verbose=0)


@pytest.mark.parametrize("strategy", params(ALL, ci=["central_storage2"]), indirect=True)
def test_fit_eval_and_predict_methods_on_dataset_without_steps(strategy):
    model = _sgd_model(strategy)
    inputs, targets = np.zeros((1000, 3), np.float32), np.zeros((1000, 4), np.float32)
    # The steps come from the arrays' length.
    fit_with_numpy = model.fit(inputs, targets, epochs=1, batch_size=10, verbose=0).history
    eval_with_numpy = model.evaluate(inputs, targets, batch_size=10, verbose=0)
    predict_with_numpy = model.predict(inputs, batch_size=10, verbose=0)
    dataset = _dataset(strategy, (inputs, targets), 10, drop_remainder=True)
    fit_with_ds = model.fit(dataset, epochs=1, verbose=0).history
    eval_with_ds = model.evaluate(dataset, verbose=0)
    predict_dataset = _dataset(strategy, inputs, 10, drop_remainder=True)
    predict_with_ds = model.predict(predict_dataset, verbose=0)
    _assert_history_close(fit_with_numpy, fit_with_ds, 1e-4)
    np.testing.assert_allclose(eval_with_numpy, eval_with_ds, atol=1e-4, rtol=1e-4)
    np.testing.assert_allclose(predict_with_numpy, predict_with_ds, atol=1e-4, rtol=1e-4)


def _unknown_cardinality(inputs, targets=None):
    """``from_tensor_slices(...).filter(lambda *_: True).batch(10, drop_remainder=True)``."""
    tf = pytest.importorskip("tensorflow")  # unknown cardinality is tf.data's
    slices = inputs if targets is None else (inputs, targets)
    dataset = tf.data.Dataset.from_tensor_slices(slices).filter(lambda *_: True)
    dataset = dataset.batch(10, drop_remainder=True)
    assert int(dataset.cardinality()) == int(tf.data.experimental.UNKNOWN_CARDINALITY)
    return dataset


@pytest.mark.parametrize("strategy", params(ALL, ci=FULL_ONLY), indirect=True)
def test_predict_on_dataset_with_unknown_cardinality_without_steps(strategy):
    model = _sgd_model(strategy)
    inputs = np.zeros((20, 3), dtype=np.float32)
    predict_dataset = _unknown_cardinality(inputs)
    predict_with_numpy = model.predict(inputs, batch_size=10, verbose=0)
    predict_with_ds = model.predict(predict_dataset, verbose=0)
    np.testing.assert_allclose(predict_with_numpy, predict_with_ds, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("strategy", params(ALL, ci=FULL_ONLY), indirect=True)
def test_on_dataset_with_unknown_cardinality_without_steps(strategy):
    model = _sgd_model(strategy)
    inputs, targets = np.zeros((100, 3), np.float32), np.zeros((100, 4), np.float32)
    dataset = _unknown_cardinality(inputs, targets)
    predict_dataset = _unknown_cardinality(inputs)
    fit_with_numpy = model.fit(inputs, targets, epochs=1, batch_size=10, verbose=0).history
    fit_with_numpy_multiple_epochs = model.fit(inputs, targets, epochs=2, batch_size=10,
                                               verbose=0).history  # fmt: skip
    eval_with_numpy = model.evaluate(inputs, targets, batch_size=10, verbose=0)
    predict_with_numpy = model.predict(inputs, batch_size=10, verbose=0)
    eval_with_ds = model.evaluate(dataset, verbose=0)
    predict_with_ds = model.predict(predict_dataset, verbose=0)
    np.testing.assert_allclose(eval_with_numpy, eval_with_ds, atol=1e-4, rtol=1e-4)
    np.testing.assert_allclose(predict_with_numpy, predict_with_ds, atol=1e-4, rtol=1e-4)
    fit_with_ds = model.fit(dataset, epochs=1, verbose=0).history
    fit_with_ds_multiple_epochs = model.fit(dataset, epochs=2, verbose=0).history
    _assert_history_close(fit_with_numpy, fit_with_ds, 1e-4)
    _assert_history_close(fit_with_numpy_multiple_epochs, fit_with_ds_multiple_epochs, 1e-4)


@pytest.mark.parametrize("strategy", params(ALL, ci=FULL_ONLY), indirect=True)
def test_fit_eval_and_predict_methods_on_dataset(strategy):
    model = _sgd_model(strategy)
    dataset = get_dataset(strategy)
    model.fit(dataset, epochs=1, steps_per_epoch=2, verbose=0)
    model.evaluate(dataset, steps=2, verbose=0)
    model.predict(get_predict_dataset(strategy), steps=2, verbose=0)


# tf-keras's Keras v2 optimizers (its v1 ``tf.compat.v1.train`` ones: not_applicable.py).
OPTIMIZERS = [
    pytest.param(lambda: keras.optimizers.Adadelta(learning_rate=0.001), id="adadelta"),
    pytest.param(lambda: keras.optimizers.Adagrad(learning_rate=0.001), id="adagrad"),
    pytest.param(lambda: keras.optimizers.Adam(learning_rate=0.001, epsilon=1.0), id="adam"),
    pytest.param(lambda: keras.optimizers.Adamax(learning_rate=0.001, epsilon=1.0), id="adamax"),
    pytest.param(lambda: keras.optimizers.SGD(learning_rate=0.001), id="sgd"),
    pytest.param(lambda: keras.optimizers.Nadam(learning_rate=0.001, epsilon=1.0), id="nadam"),
    pytest.param(lambda: keras.optimizers.RMSprop(learning_rate=0.001), id="rmsprop"),
    pytest.param(lambda: keras.optimizers.Ftrl(learning_rate=0.001), id="ftrl"),
]


@pytest.mark.parametrize("optimizer", OPTIMIZERS)
@pytest.mark.parametrize("strategy", params(ALL, ci=FULL_ONLY), indirect=True)
def test_fit_eval_and_predict_with_optimizer(strategy, optimizer):
    with strategy.scope():
        model = get_model()
        model.compile(optimizer(), "mse")
    dataset = get_dataset(strategy)
    model.fit(dataset, epochs=1, steps_per_epoch=2, verbose=0)
    model.evaluate(dataset, steps=2, verbose=0)
    model.predict(get_predict_dataset(strategy), steps=2, verbose=0)


@pytest.mark.parametrize(
    "strategy", params(["mirrored2", "one_device"], ci=FULL_ONLY), indirect=True
)
def test_dataset_wrong_input_shape(strategy):
    with strategy.scope():
        model = get_model()
        model.compile(keras.optimizers.SGD(learning_rate=0.001), "mse")
    inputs = np.zeros((10, 5), dtype=np.float32)  # wrong input shape
    targets = np.zeros((10, 4), dtype=np.float32)
    dataset = _dataset(strategy, (inputs, targets), 10, repeat=100)
    with pytest.raises(ValueError, match="is incompatible with"):
        model.fit(dataset, epochs=1, steps_per_epoch=2, verbose=0)


class _Batches(keras.utils.PyDataset):
    """Batches made outside any ``batch`` call: the elements are the batches."""

    def __init__(self, inputs, targets):
        super().__init__()
        self.inputs, self.targets = inputs, targets

    def __len__(self):
        return len(self.inputs)

    def __getitem__(self, index):
        return self.inputs[index], self.targets[index]


@pytest.mark.parametrize("strategy", params(["mirrored2"], ci=FULL_ONLY), indirect=True)
def test_dataset_external_batch_input_validation(strategy):
    with strategy.scope():
        model = get_model()
        model.compile(keras.optimizers.SGD(learning_rate=0.001), "mse")
    # ``from_tensor_slices`` of (100, 10, 3) arrays: every element is a batch of 10.
    # keras_dist's unbatched NumPy dataset asks for ``.batch(n)``; a ``PyDataset``
    # gives batches made outside.
    inputs = np.zeros((100, 10, 3), dtype=np.float32)
    targets = np.zeros((100, 10, 4), dtype=np.float32)
    model.fit(_Batches(inputs, targets), epochs=1, steps_per_epoch=2, verbose=0)


@pytest.mark.parametrize("strategy", params(["mirrored2"], ci=FULL_ONLY), indirect=True)
def test_learning_phase_value(strategy):
    with strategy.scope():
        x = keras.Input((1,), name="input")
        y = keras.layers.Dense(1, kernel_initializer="ones")(x)
        z = keras.layers.Dropout(0.9999)(y)
        model = keras.Model(x, z)
        initial_weights = model.get_weights()
        model.compile(keras.optimizers.SGD(0.005), "mse", metrics=["acc"])
    # MirroredStrategy takes the global batch size.
    batch_size = 8 * strategy.num_replicas_in_sync
    inputs, targets = np.ones((10, 1), np.float32), np.ones((10, 1), np.float32)
    dataset = _dataset(strategy, (inputs, targets), batch_size, repeat=20 * batch_size)
    hist = model.fit(dataset, epochs=1, steps_per_epoch=20, verbose=0)
    assert round(hist.history["acc"][0]) == 0  # assertAlmostEqual(acc, 0, places=0)
    with strategy.scope():
        model.set_weights(initial_weights)
    predict_dataset = _dataset(strategy, inputs, batch_size, repeat=10 * batch_size)
    output = model.predict(predict_dataset, steps=10, verbose=0)
    # 10 steps of 16 rows.
    ref_output = np.ones((160, 1), dtype=np.float32)
    np.testing.assert_allclose(output, ref_output, atol=1e-1)


@pytest.mark.parametrize("strategy", params(ALL, ci=FULL_ONLY), indirect=True)
def test_optimizer_with_callbacks(strategy):
    # testOptimizerWithCallbacks.
    with strategy.scope():
        model = get_model()
        model.compile(keras.optimizers.SGD(0.01), "mse")
    dataset = get_dataset(strategy)
    model.fit(dataset, epochs=1, steps_per_epoch=2, verbose=0,
              callbacks=[keras.callbacks.LearningRateScheduler(lambda _: 0.001)])  # fmt: skip
    np.testing.assert_allclose(float(np.asarray(model.optimizer.learning_rate)), 0.001)


@pytest.mark.parametrize("batch_size", [4, 6])
@pytest.mark.parametrize("strategy", params(ALL, ci=FULL_ONLY), indirect=True)
def test_evaluate_with_dataset_with_partial_batch(strategy, batch_size):
    metrics = lambda: ["mae", keras.metrics.CategoricalAccuracy()]  # noqa: E731
    with strategy.scope():
        model_with_ds_strategy = get_model()
        model_with_ds_strategy.compile(keras.optimizers.SGD(0.001), "mse", metrics=metrics())
    cpu_model = get_model()
    cpu_model.compile(keras.optimizers.SGD(0.001), "mse", metrics=metrics())
    x = np.random.random((10, 3)).astype("float32")
    y = np.random.random((10, 4)).astype("float32")
    cpu_model.set_weights(model_with_ds_strategy.get_weights())
    # 10 samples: the last batch is partial. The loss is not compared (see above).
    dataset_with_partial_batch = _dataset(strategy, (x, y), batch_size)
    cpu_dataset = _dataset(None, (x, y), batch_size)
    steps = int(np.ceil(10.0 / batch_size))
    np.testing.assert_allclose(
        model_with_ds_strategy.evaluate(dataset_with_partial_batch, steps=steps, verbose=0)[1:],
        cpu_model.evaluate(cpu_dataset, steps=steps, verbose=0)[1:], atol=1e-5, rtol=1e-5,
    )  # fmt: skip
    np.testing.assert_allclose(
        model_with_ds_strategy.evaluate(dataset_with_partial_batch, verbose=0)[1:],
        cpu_model.evaluate(cpu_dataset, verbose=0)[1:], atol=1e-5, rtol=1e-5,
    )  # fmt: skip


@pytest.mark.parametrize("strategy", params(ALL, ci=FULL_ONLY), indirect=True)
def test_predict_with_dataset_with_partial_batch(strategy):
    model_with_ds_strategy, cpu_model = _model_and_cpu_model(strategy, get_model)
    inputs = np.random.random((10, 3)).astype(np.float32)
    # 10 samples in batches of 4: the last one is partial.
    np.testing.assert_allclose(
        model_with_ds_strategy.predict(_dataset(strategy, inputs, 4), steps=3, verbose=0),
        cpu_model.predict(_dataset(None, inputs, 4), steps=3, verbose=0), atol=1e-5, rtol=1e-5,
    )  # fmt: skip


@pytest.mark.parametrize("strategy", params(ALL, ci=FULL_ONLY), indirect=True)
def test_predict_multi_output_model_with_dataset_with_partial_batch(strategy):
    model_with_ds_strategy, cpu_model = _model_and_cpu_model(
        strategy, simple_multi_inputs_multi_outputs_model
    )
    input_dict = _multi_inputs_data()
    # 200 samples in 12 batches of 18: the last one is partial.
    _correctness.assert_all_close(
        model_with_ds_strategy.predict(_dataset(strategy, input_dict, 18), steps=12, verbose=0),
        cpu_model.predict(_dataset(None, input_dict, 18), steps=12, verbose=0),
        atol=1e-4, rtol=1e-4,
    )  # fmt: skip


@pytest.mark.parametrize("strategy", params(MINUS_DEFAULT, ci=FULL_ONLY), indirect=True)
def test_match_model_input_matches_with_dataset_tensors(strategy):
    def _create_model_input_output_tensors():
        input_a = keras.Input((16,), name="z_input_sorted_last")
        input_b = keras.Input((32,), name="a_input_sorted_first")
        intermediate_a = keras.layers.Dense(10)(input_a)
        intermediate_b = keras.layers.Dense(10)(input_b)
        merged = keras.layers.Add()([intermediate_a, intermediate_b])
        output = keras.layers.Dense(2)(merged)
        return input_a, input_b, output

    input_dict = {
        "z_input_sorted_last": np.random.rand(32, 16).astype(np.float32),
        "a_input_sorted_first": np.random.rand(32, 32).astype(np.float32),
    }
    target = np.ones((32, 2), dtype=np.float32)
    dataset = _dataset(strategy, (input_dict, target), 4, drop_remainder=True)
    with strategy.scope():
        # ``input_a``, whose name sorts last, is the model's first input: a dict of
        # inputs flattened blindly would give it ``a_input_sorted_first`` (a shape error).
        input_a, input_b, output = _create_model_input_output_tensors()
        model_with_array_input = keras.Model(inputs=[input_a, input_b], outputs=output)
        model_with_array_input.compile("sgd", "mse")
        model_weights = model_with_array_input.get_weights()
        model_with_array_input_fit = model_with_array_input.fit(
            dataset, steps_per_epoch=1, epochs=1, verbose=0
        ).history
        input_a, input_b, output = _create_model_input_output_tensors()
        model_with_dict_input = keras.Model(
            inputs={"z_input_sorted_last": input_a, "a_input_sorted_first": input_b},
            outputs=output,
        )
        model_with_dict_input.compile("sgd", "mse")
        model_with_dict_input.set_weights(model_weights)
        model_with_dict_input_fit = model_with_dict_input.fit(
            dataset, steps_per_epoch=1, epochs=1, verbose=0
        ).history
        _assert_history_close(model_with_dict_input_fit, model_with_array_input_fit, 1e-4)


@pytest.mark.parametrize("strategy", params(ALL, ci=FULL_ONLY), indirect=True)
def test_dataset_with_sample_weights(strategy):
    model = _sample_weights_model(strategy)
    ds = _dataset(strategy, (SAMPLE_INPUTS, SAMPLE_TARGETS, SAMPLE_WEIGHTS), 2)
    result = model.evaluate(ds, verbose=0)
    # As test_numpy_with_sample_weights: (2.75 + 18.5) / 2 = 10.625.
    np.testing.assert_allclose(result, 10.625, rtol=1e-6, atol=1e-6)
    ds = _dataset(strategy, (SAMPLE_INPUTS, SAMPLE_TARGETS), 2)
    result = model.evaluate(ds, verbose=0)
    np.testing.assert_allclose(result, 13.5, rtol=1e-6, atol=1e-6)


# --- TestRegularizerLoss -------------------------------------------------------------------


class IdentityRegularizer(keras.regularizers.Regularizer):
    def __call__(self, x):
        return x


class AddLayer(keras.layers.Layer):
    def build(self, _):
        self.v = self.add_weight(name="v", shape=(), initializer="ones",
                                 regularizer=IdentityRegularizer())  # fmt: skip

    def call(self, inputs):
        return inputs + self.v


@pytest.mark.parametrize("strategy", params(MINUS_DEFAULT, ci=["mirrored2"]), indirect=True)
def test_regularizer_loss(strategy):
    # keras_dist takes global batch sizes (tf-keras's global_batch_size_supported).
    batch_size = 2
    # With x = 1 and v initialized to 1, the loss is x + v + regularizer_loss = 1 + 2v:
    # dLoss/dv = 2, averaged over the batch, times the learning rate 1: one step takes v
    # to -1. A regularizer loss not scaled by the number of replicas gives -2 on 2.
    with strategy.scope():
        x = keras.Input((1,), batch_size=batch_size)
        y = AddLayer()(x)
        model = keras.Model(inputs=x, outputs=y)
        model.compile(keras.optimizers.SGD(1.0), loss=lambda _, y_pred: keras.ops.mean(y_pred))
        model.fit(x=np.array([[1.0], [1.0]], dtype=np.float32),
                  y=np.array([[1.0], [1.0]], dtype=np.float32), batch_size=batch_size,
                  verbose=0)  # fmt: skip
        v = model.get_weights()[0]
        assert v == -1.0


# --- TestDistributionStrategyWithKerasModels -------------------------------------------


@pytest.mark.parametrize("strategy", params(ALL, ci=FULL_ONLY), indirect=True)
def test_distribution_strategy_on_sequential_model(strategy):
    with strategy.scope():
        model = simple_sequential_model()
        model.compile(keras.optimizers.SGD(learning_rate=0.001), "mse")
        inputs, targets = np.zeros((20, 10), np.float32), np.zeros((20, 2), np.float32)
    model.fit(inputs, targets, epochs=1, batch_size=10, verbose=0)
    model.predict(inputs, batch_size=10, verbose=0)
    model.evaluate(inputs, targets, batch_size=10, verbose=0)


@pytest.mark.parametrize("strategy", params(ALL, ci=FULL_ONLY), indirect=True)
def test_distribution_strategy_on_functional_model(strategy):
    with strategy.scope():
        model = get_model()
        model.compile(keras.optimizers.SGD(learning_rate=0.001), "mse")
        inputs, targets = np.zeros((64, 3), np.float32), np.zeros((64, 4), np.float32)
    model.fit(inputs, targets, epochs=1, verbose=0)
    model.predict(inputs, verbose=0)
    model.evaluate(inputs, targets, verbose=0)


class CBCounter(keras.callbacks.Callback):
    def __init__(self):
        super().__init__()
        self.epochs = 0
        self.train_batches = 0
        self.test_batches = 0

    def on_epoch_end(self, batch, logs=None):
        self.epochs += 1

    def on_train_batch_end(self, batch, logs=None):
        self.train_batches += 1

    def on_test_batch_end(self, batch, logs=None):
        self.test_batches += 1


# tf-keras's TF raised "When providing a distributed dataset, you must specify the
# number of steps" for any distributed dataset on several replicas (their length was
# unknown to it); keras_dist knows a finite one's length and reads it to its end
# (not_applicable.py), and refuses an endless one with tf-keras's infinite-dataset
# ValueError, which names the distributed dataset.
NO_STEPS = "you must specify the number of steps to run"


@pytest.mark.parametrize("strategy", params(ALL, ci=FULL_ONLY), indirect=True)
def test_distributed_dataset(strategy):
    with strategy.scope():
        model = keras.Sequential([keras.layers.Dense(1)])
        model.compile("sgd", "mse")
        cb_counter = CBCounter()
        x, y = np.ones((100, 10)), np.ones((100, 1))
        ds = strategy.experimental_distribute_dataset(_dataset(strategy, (x, y), 10, repeat=2))
        val_ds = strategy.experimental_distribute_dataset(_dataset(strategy, (x, y), 20))
        model.fit(ds, steps_per_epoch=10, validation_data=val_ds, validation_steps=5, epochs=2,
                  callbacks=[cb_counter], verbose=0)  # fmt: skip
        assert cb_counter.train_batches == 20
        assert cb_counter.test_batches == 10
        assert cb_counter.epochs == 2


@pytest.mark.parametrize("strategy", params(ALL, ci=["mirrored2"]), indirect=True)
def test_distributed_datasets_from_function(strategy):
    with strategy.scope():
        model = keras.Sequential([keras.layers.Dense(1)])
        model.compile("sgd", "mse")
        cb_counter = CBCounter()

        def make_dataset(_):
            x, y = np.ones((100, 10)), np.ones((100, 1))
            # ``.batch(5).repeat()``
            return _Repeated([(x[i : i + 5], y[i : i + 5]) for i in range(0, 100, 5)])

        ds = strategy.distribute_datasets_from_function(make_dataset)
        val_ds = strategy.distribute_datasets_from_function(make_dataset)
        model.fit(ds, steps_per_epoch=10, validation_data=val_ds, validation_steps=5, epochs=2,
                  callbacks=[cb_counter], verbose=0)  # fmt: skip
        assert cb_counter.train_batches == 20
        assert cb_counter.test_batches == 10
        assert cb_counter.epochs == 2
        # Check for ``steps_per_epoch``.
        if strategy.num_replicas_in_sync > 1:
            with pytest.raises(ValueError, match=NO_STEPS):
                model.fit(ds, epochs=2, verbose=0)


class BatchCountingCB(keras.callbacks.Callback):
    def __init__(self):
        super().__init__()
        self.train_begin_batches = []
        self.train_end_batches = []
        self.test_begin_batches = []
        self.test_end_batches = []
        self.predict_begin_batches = []
        self.predict_end_batches = []

    def on_train_batch_begin(self, batch, logs=None):
        self.train_begin_batches.append(batch)

    def on_train_batch_end(self, batch, logs=None):
        self.train_end_batches.append(batch)

    def on_test_batch_begin(self, batch, logs=None):
        self.test_begin_batches.append(batch)

    def on_test_batch_end(self, batch, logs=None):
        self.test_end_batches.append(batch)

    def on_predict_batch_begin(self, batch, logs=None):
        self.predict_begin_batches.append(batch)

    def on_predict_batch_end(self, batch, logs=None):
        self.predict_end_batches.append(batch)


def _dense_model(strategy, steps_per_execution):
    with strategy.scope():
        inputs = keras.Input((10,))
        model = keras.Model(inputs, keras.layers.Dense(1)(inputs))
    model.compile("sgd", "mse", steps_per_execution=steps_per_execution)
    return model


@pytest.mark.parametrize("strategy", params(ALL, ci=FULL_ONLY), indirect=True)
def test_host_training_loop(strategy):
    with strategy.scope():
        inputs = keras.Input((10, 10, 3))
        x = keras.layers.Conv2D(3, kernel_size=3)(inputs)
        x = keras.layers.Flatten()(x)
        model = keras.Model(inputs, keras.layers.Dense(1)(x))
    model.compile("sgd", "mse", steps_per_execution=10)
    bc = BatchCountingCB()
    x, y = np.ones((100, 10, 10, 3)), np.ones((100, 1))
    model.fit(x, y, batch_size=2, epochs=1, callbacks=[bc], verbose=0)
    assert bc.train_begin_batches == [0, 10, 20, 30, 40]
    assert bc.train_end_batches == [9, 19, 29, 39, 49]
    model.evaluate(x, y, batch_size=2, callbacks=[bc], verbose=0)
    assert bc.test_begin_batches == [0, 10, 20, 30, 40]
    assert bc.test_end_batches == [9, 19, 29, 39, 49]
    model.predict(x, batch_size=2, callbacks=[bc], verbose=0)
    assert bc.predict_begin_batches == [0, 10, 20, 30, 40]
    assert bc.predict_end_batches == [9, 19, 29, 39, 49]


# These three on the default strategy: not_applicable.py (plain Keras 3's loop).
@pytest.mark.parametrize("strategy", params(MINUS_DEFAULT, ci=["central_storage2"]), indirect=True)
def test_host_training_loop_last_partial_execution(strategy):
    model = _dense_model(strategy, 20)
    bc = BatchCountingCB()
    x, y = np.ones((100, 10)), np.ones((100, 1))
    model.fit(x, y, batch_size=2, epochs=1, callbacks=[bc], verbose=0)
    assert bc.train_begin_batches == [0, 20, 40]
    assert bc.train_end_batches == [19, 39, 49]
    model.evaluate(x, y, batch_size=2, callbacks=[bc], verbose=0)
    assert bc.test_begin_batches == [0, 20, 40]
    assert bc.test_end_batches == [19, 39, 49]
    model.predict(x, batch_size=2, callbacks=[bc], verbose=0)
    assert bc.predict_begin_batches == [0, 20, 40]
    assert bc.predict_end_batches == [19, 39, 49]


@pytest.mark.parametrize("strategy", params(MINUS_DEFAULT, ci=FULL_ONLY), indirect=True)
def test_host_training_loop_dataset_unknown_size(strategy):
    # The data of unknown size refused without steps: not_applicable.py. With steps,
    # ``ds.repeat(2)`` read for 50 steps an epoch.
    model = _dense_model(strategy, 20)
    x, y = np.ones((100, 10)), np.ones((100, 1))
    bc = BatchCountingCB()
    train_ds = _dataset(strategy, (x, y), 2, repeat=2)
    model.fit(train_ds, steps_per_epoch=50, epochs=2, callbacks=[bc], verbose=0)
    assert bc.train_begin_batches == [0, 20, 40, 0, 20, 40]
    assert bc.train_end_batches == [19, 39, 49, 19, 39, 49]
    model.evaluate(train_ds, steps=50, callbacks=[bc], verbose=0)
    assert bc.test_begin_batches == [0, 20, 40]
    assert bc.test_end_batches == [19, 39, 49]
    model.predict(_dataset(strategy, x, 2, repeat=2), steps=50, callbacks=[bc], verbose=0)
    assert bc.predict_begin_batches == [0, 20, 40]
    assert bc.predict_end_batches == [19, 39, 49]


@pytest.mark.parametrize("strategy", params(MINUS_DEFAULT, ci=FULL_ONLY), indirect=True)
def test_host_training_loop_truncate_to_epoch(strategy):
    model = _dense_model(strategy, 500)
    x, y = np.ones((100, 10)), np.ones((100, 1))
    bc = BatchCountingCB()
    model.fit(x, y, batch_size=2, epochs=2, callbacks=[bc], verbose=0)
    assert bc.train_begin_batches == [0, 0]
    assert bc.train_end_batches == [49, 49]
    x, y = np.ones((50, 10)), np.ones((50, 1))
    model.evaluate(x, y, batch_size=2, callbacks=[bc], verbose=0)
    assert bc.test_begin_batches == [0]
    assert bc.test_end_batches == [24]
    model.predict(np.ones((50, 10)), batch_size=2, callbacks=[bc], verbose=0)
    assert bc.predict_begin_batches == [0]
    assert bc.predict_end_batches == [24]


class _TwoVariables(keras.layers.Layer):
    def build(self, _):
        self.v1 = self.add_weight(name="v1", shape=(), initializer="ones")
        self.v2 = self.add_weight(name="v2", shape=(), initializer="ones")

    def call(self, x):
        return 3 * self.v1 - 3 * self.v2


# tf-keras's legacy SGD takes clipnorm=2.0 and clipvalue=2.0 together; Keras 3's takes
# one: each alone clips the gradients (-3, 3) to (-2, 2), as both did. tf-keras expects
# "not supported" under CentralStorageStrategy, whose legacy optimizer could not clip
# there (not_applicable.py); keras_dist clips, and gets the same numbers.
@pytest.mark.parametrize("clip", [{"clipnorm": 2.0}, {"clipvalue": 2.0}], ids=["clipnorm",
                                                                          "clipvalue"])  # fmt: skip
@pytest.mark.parametrize("strategy", params(ALL, ci=FULL_ONLY), indirect=True)
def test_gradient_clipping(strategy, clip):
    x, y = np.ones((10, 1)), np.ones((10, 1))
    with strategy.scope():
        layer = _TwoVariables()
        model = keras.Sequential([layer])
        optimizer = keras.optimizers.SGD(1.0, **clip)
    model.compile(optimizer, "mae")
    model.fit(x, y, batch_size=10, epochs=1, verbose=0)
    np.testing.assert_allclose(np.asarray(layer.v1), 3.0, rtol=1e-6)
    np.testing.assert_allclose(np.asarray(layer.v2), -1.0, rtol=1e-6)


@pytest.mark.parametrize("strategy", params(MINUS_DEFAULT, ci=FULL_ONLY), indirect=True)
def test_distribution_strategy_one_dimensional(strategy):
    with strategy.scope():
        inp = keras.Input((10,))
        out = keras.layers.Dense(3, activation="softmax")(inp)
        model = keras.Model(inputs=[inp], outputs=[out])
        model.compile(optimizer="rmsprop", loss="sparse_categorical_crossentropy",
                      metrics=["sparse_categorical_accuracy"])  # fmt: skip
        x = np.random.random((64, 10)).astype("float32")
        y = np.random.randint(3, size=64)
        model.fit(x, y, epochs=1, steps_per_epoch=2, verbose=0)


# ReductionV2.AUTO is Keras 3's default, SUM_OVER_BATCH_SIZE, SUM.
REDUCTIONS = [
    pytest.param({}, id="auto"),
    pytest.param({"reduction": "sum_over_batch_size"}, id="sum_over_batch_size"),
    pytest.param({"reduction": "sum"}, id="sum"),
]


# tf-keras's mirrored_strategy_with_gpu_and_cpu and _with_two_gpus: mirrored2.
@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("strategy", params(["mirrored2"]), indirect=True)
def test_distribution_strategy_with_loss_reduction_types(strategy, reduction):
    np.random.seed(RANDOM_SEED)

    def _get_model():
        inputs = keras.Input((10,))
        x1 = keras.layers.Dense(10, kernel_initializer="zeros")(inputs)
        x2 = keras.layers.Dense(10, kernel_initializer="zeros")(x1)
        outputs = keras.layers.Dense(1, kernel_initializer="zeros")(x2)
        return keras.Model(inputs, outputs)

    x = np.random.random((64, 10))
    y = np.random.random((64, 1))
    model = _get_model()
    model.compile("sgd", loss=keras.losses.MeanSquaredError(**reduction))
    history = model.fit(_dataset(None, (x, y), 32), steps_per_epoch=2, epochs=1,
                        shuffle=False, verbose=0)  # fmt: skip
    with strategy.scope():
        ds_model = _get_model()
        ds_model.compile("sgd", loss=keras.losses.MeanSquaredError(**reduction))
        ds_history = ds_model.fit(_dataset(strategy, (x, y), 32), steps_per_epoch=2, epochs=1,
                                  shuffle=False, verbose=0)  # fmt: skip
    np.testing.assert_allclose(history.history["loss"], ds_history.history["loss"], atol=1e-5)
    if reduction.get("reduction") == "sum":
        # The no-strategy loss tf-keras gets on these numbers.
        np.testing.assert_allclose(history.history["loss"], [6.30027], atol=1e-5)


class _MeanLoss(keras.layers.Layer):
    """``model.add_loss(tf.reduce_mean(t))`` of a model's tensor ``t``: Keras 3 adds
    losses in a layer's ``call``."""

    def call(self, inputs):
        self.add_loss(keras.ops.mean(inputs))
        return inputs


@pytest.mark.parametrize("strategy", params(MINUS_DEFAULT, ci=FULL_ONLY), indirect=True)
def test_distribution_strategy_with_symbolic_add_loss(strategy):
    def _make_model_with_add_loss():
        inputs = keras.Input((10,))
        x1 = _MeanLoss()(keras.layers.Dense(10, kernel_initializer="zeros")(inputs))
        x2 = keras.layers.Dense(10, kernel_initializer="zeros")(x1)
        outputs = _MeanLoss()(keras.layers.Dense(1, kernel_initializer="zeros")(x2))
        return keras.Model(inputs, outputs)

    x = np.ones((64, 10)).astype("float32")
    model = _make_model_with_add_loss()
    model.compile("sgd")
    history = model.fit(x, epochs=1, verbose=0)
    with strategy.scope():
        ds_model = _make_model_with_add_loss()
        ds_model.compile("sgd")
        ds_history = ds_model.fit(x, epochs=1, verbose=0)
    _assert_history_close(history.history, ds_history.history, 1e-6)


class _KernelLoss(keras.layers.Layer):
    """``model.add_loss(lambda: 100.0 * tf.reduce_mean(d.kernel))``: Keras 3 has no
    callable losses; the layer adds the same loss at each call."""

    def __init__(self, dense, **kwargs):
        super().__init__(**kwargs)
        self.dense = dense

    def call(self, inputs):
        self.add_loss(100.0 * keras.ops.mean(self.dense.kernel))
        return inputs


@pytest.mark.parametrize("strategy", params(MINUS_DEFAULT, ci=FULL_ONLY),
                         indirect=True)  # fmt: skip
def test_distribution_strategy_with_callable_add_loss(strategy):
    def _make_model():
        inputs = keras.Input((10,))
        x1 = keras.layers.Dense(10, kernel_initializer="zeros")(inputs)
        x2 = keras.layers.Dense(10, kernel_initializer="zeros")(x1)
        d = keras.layers.Dense(1, kernel_initializer="zeros")
        outputs = _KernelLoss(d)(d(x2))
        return keras.Model(inputs, outputs)

    x = np.ones((64, 10)).astype("float32")
    y = np.ones((64, 1)).astype("float32")
    model = _make_model()
    model.compile("sgd", "mse")
    history = model.fit(x, y, steps_per_epoch=2, epochs=1, verbose=0)
    with strategy.scope():
        ds_model = _make_model()
        ds_model.compile("sgd", "mse")
        ds_history = ds_model.fit(x, y, steps_per_epoch=2, epochs=1, verbose=0)
    _assert_history_close(history.history, ds_history.history, 1e-6)


class _LabelLoss(keras.layers.Layer):
    """``model.add_loss(keras.losses.mean_squared_error(labels, y))``."""

    def call(self, inputs):
        labels, y = inputs
        self.add_loss(keras.losses.mean_squared_error(labels, y))
        return y


@pytest.mark.parametrize("strategy", params(MINUS_DEFAULT, ci=FULL_ONLY), indirect=True)
def test_correctness_of_add_loss_with_merge_call(strategy):
    batch_size = 32

    def _get_model():
        inputs = keras.Input((1,))
        labels = keras.Input((1,))
        x = keras.layers.Dense(10, activation="relu")(inputs)
        y = keras.layers.Dense(1)(x)
        return keras.Model([inputs, labels], _LabelLoss()([labels, y]))

    x_train = np.random.rand(64, 1).astype("float32")
    y_train = (3 * x_train).astype("float32")
    batches = [(x_train[i : i + batch_size], y_train[i : i + batch_size])
               for i in range(0, 64, batch_size)]  # fmt: skip
    with strategy.scope():
        model = _get_model()
        optimizer = keras.optimizers.SGD(0.2)

        @kd.function
        def train_step(dist_inputs):
            def step_fn(inputs):
                def loss_fn():
                    logits = model(inputs)
                    # Invoke a merge_call().
                    kd.get_replica_context().merge_call(lambda d: None)
                    # There is only one loss on the model.
                    assert len(model.losses) == 1
                    loss_from_model = keras.ops.sum(model.losses) * 1.0 / batch_size
                    # The loss computed here equals the model's, added by add_loss.
                    loss = keras.losses.mean_squared_error(inputs[1], logits)
                    loss = kd.nn.compute_average_loss(loss, global_batch_size=batch_size)
                    return loss, loss_from_model

                (loss, loss_from_model), grads = kd.value_and_grad(
                    loss_fn, model.trainable_variables, has_aux=True
                )()
                optimizer.apply_gradients(zip(grads, model.trainable_variables))
                return loss, loss_from_model

            losses = strategy.run(step_fn, args=(dist_inputs,))
            return strategy.experimental_local_results(losses)

        dataset = strategy.experimental_distribute_dataset(batches)
        for _ in range(2):
            for x in dataset:
                for loss, loss_from_model in train_step(x):
                    # tf.compat.v1.assert_equal(loss, loss_from_model)
                    np.testing.assert_array_equal(np.asarray(loss), np.asarray(loss_from_model))


# --- TestModelCapturesStrategy ---------------------------------------------------------------


class DeterministicModel(keras.Model):
    """Always outputs its input times 1; ``call`` checks it runs under the model's strategy."""

    def __init__(self, strategy):
        super().__init__()
        self.x = None
        self.strategy = strategy

    def build(self, input_shape):
        self.x = self.add_weight(name="x", shape=(), initializer="ones")

    def call(self, inputs, training=None, mask=None):
        if kd.get_strategy() is not self.strategy:
            raise ValueError("Model must execute call w/ the original strategy")
        return self.x * inputs


@pytest.mark.parametrize("strategy", params(ALL, ci=["mirrored2"]), indirect=True)
def test_model_captures_strategy_fit_and_evaluate(strategy):
    # TestModelCapturesStrategy.test_fit_and_evaluate.
    ones = np.ones((64,), "float32")
    dataset = _dataset(strategy, (ones, ones), 8 * strategy.num_replicas_in_sync)
    with strategy.scope():
        model = DeterministicModel(strategy)
        optimizer = keras.optimizers.Adam(1e-4)
    # Compiled outside the strategy's scope.
    model.compile(optimizer=optimizer, loss=keras.losses.MeanSquaredError(),
                  metrics=["binary_accuracy"])  # fmt: skip
    # ``optimizer.iterations`` read out of the strategy's scope.
    assert int(np.asarray(model.optimizer.iterations)) == 0
    for _ in range(2):
        model.fit(dataset, verbose=0)
    # tf-keras's ``dict(zip(model.metrics_names, ...))``: Keras 3 names the compiled
    # metrics together ("compile_metrics"), ``return_dict`` names each.
    results = model.evaluate(dataset, verbose=0, return_dict=True)
    assert results["binary_accuracy"] == 1.0
    np.testing.assert_allclose(results["loss"], 0.0, atol=1e-6)
    # Every metric, optimizer and model variable was made in the strategy (compile used
    # the captured strategy).
    metric_vars = [v for metric in model.metrics for v in metric.variables]
    for var in metric_vars + list(model.optimizer.variables) + list(model.variables):
        assert strategy.extended.variable_created_in_scope(var), var.path
    # A metric made in the model's scope is accepted.
    with strategy.scope():
        metric = keras.metrics.BinaryAccuracy()
    model.compile(optimizer=optimizer, loss=keras.losses.MeanSquaredError(), metrics=[metric])
    # tf-keras's last check (a metric made outside the scope raises) runs only when a
    # strategy is current (``tf.distribute.has_strategy()``), which it is not there.


@pytest.mark.parametrize("strategy", params(["mirrored1"], ci=FULL_ONLY), indirect=True)
def test_model_captures_strategy_optimizer(strategy, tmp_path):
    # TestModelCapturesStrategy.test_optimizer: Keras 3's optimizer (tf-keras's V3) is
    # restored in the scope, its variables distributed.
    path = str(tmp_path / "ckpt.weights.h5")

    def create_model():
        model = keras.Sequential([keras.layers.Dense(1)])
        model.compile(optimizer=keras.optimizers.Adam(), loss="mse")
        model.build([None, 1])  # create the weights
        return model

    model = create_model()
    x = y = np.ones((1, 1), "float32")
    model.fit(x=x, y=y, batch_size=1, verbose=0)
    model.save_weights(path)
    with strategy.scope():
        model = create_model()
        model.load_weights(path)
        model.optimizer.build(model.trainable_variables)
        variables = model.optimizer.variables
        assert variables
        assert isinstance(variables[0], kd.MirroredVariable)
