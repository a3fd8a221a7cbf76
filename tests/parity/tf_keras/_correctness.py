"""tf-keras's ``keras_correctness_test_base.py``: fit, evaluate, predict, with or without one.

The harness trains one model under the strategy and one without, from the same weights
on the same data, and compares histories, evaluations, weights and predictions with
tf-keras's tolerances. ``use_numpy=False`` stands for tf-keras's ``tf.data`` input: a
batched ``experimental_make_numpy_dataset``, read in order as ``fit`` reads a
``tf.data`` dataset; its ``repeat(epochs)`` is the arrays tiled ``epochs`` times (so
that, as in TF, a batch may span two epochs).
"""

import contextlib

import keras
import numpy as np

import keras_dist as kd

RANDOM_SEED = 1337
# The initial weights are drawn with seed 0, the data with tf-keras's 1337. With Keras's
# seed-1337 weights the DNN's first ReLU has its kink inside the data (x ~ 0.01): rows
# there switch sides on a last-bit difference in the summation order of 2 replicas, and
# the weights after 4 epochs differ from one device's by 4.8e-5 (> 4e-5) with no error
# in the computation (tests/keras_integration/test_fit.py shows the same run agreeing
# to 1e-11 in float64). tf-keras's own weights come from TF's generator, so no seed
# reproduces them; the tolerances stay tf-keras's.
WEIGHTS_SEED = 0
GLOBAL_BATCH_SIZE = 64


def scope(strategy):
    """tf-keras's ``MaybeDistributionScope``: the strategy's scope, or none."""
    return strategy.scope() if strategy is not None else contextlib.nullcontext()


def _dataset(strategy, arrays, batch_size, repeat=None):
    """``from_tensor_slices(arrays)[.repeat(repeat)].batch(batch_size)``."""
    if repeat:
        arrays = keras.tree.map_structure(lambda a: np.concatenate([a] * repeat), arrays)
    return (strategy or kd.get_strategy()).experimental_make_numpy_dataset(arrays).batch(batch_size)


def correctness_test_inputs(
    use_numpy, use_validation_data, strategy, x_train, y_train, x_eval, y_eval, x_predict, epochs
):
    """tf-keras's ``get_correctness_test_inputs``: the keyword arguments of each call.

    keras_dist takes global batch sizes everywhere (tf-keras's
    ``global_batch_size_supported``), so the batch size is 64 with or without a strategy.
    """
    batch_size = GLOBAL_BATCH_SIZE
    if use_numpy:
        training = dict(x=x_train, y=y_train, batch_size=batch_size, epochs=epochs, shuffle=False)
        if use_validation_data:
            evaluation = None
            training["validation_data"] = (x_eval, y_eval)
        else:
            evaluation = dict(x=x_eval, y=y_eval, batch_size=batch_size)
        return training, evaluation, dict(x=x_predict)
    training = dict(
        x=_dataset(strategy, (x_train, y_train), batch_size, repeat=epochs),
        epochs=epochs,
        shuffle=False,
        steps_per_epoch=int(np.ceil(len(x_train) / GLOBAL_BATCH_SIZE)),
    )
    eval_dataset = _dataset(strategy, (x_eval, y_eval), batch_size)
    if use_validation_data:
        evaluation = None
        training["validation_data"] = eval_dataset
        training["validation_steps"] = 5
    else:
        steps = int(np.ceil(len(x_eval) / GLOBAL_BATCH_SIZE))
        evaluation = dict(x=eval_dataset, steps=steps)
    predict = dict(x=_dataset(strategy, x_predict, len(x_predict)), steps=1)
    return training, evaluation, predict


def fit_eval_and_predict(initial_weights, inputs, model_fn, strategy=None):
    """fit, evaluate, predict, then fit and evaluate again, as a user would."""
    training, evaluation, predict = inputs
    model = model_fn(initial_weights=initial_weights, strategy=strategy)
    result = {}
    for run in (1, 2):
        result[f"training_history_{run}"] = model.fit(**training, verbose=0).history
        if evaluation is not None:
            result[f"eval_result_{run}"] = model.evaluate(**evaluation, verbose=0)
        result[f"weights_{run}"] = model.get_weights()
        if run == 1 and predict is not None:
            result["predict_result_0"] = model.predict(**predict, verbose=0)
    return result


def assert_all_close(actual, expected, atol, rtol, msg=""):
    """``tf.test.TestCase.assertAllClose`` over nests of dicts, lists and arrays."""
    if isinstance(expected, dict):
        assert isinstance(actual, dict) and sorted(actual) == sorted(expected), msg
        for key in expected:
            assert_all_close(actual[key], expected[key], atol, rtol, f"{msg}[{key}]")
        return
    if isinstance(expected, (list, tuple)) and not np.isscalar(expected):
        assert len(actual) == len(expected), msg
        for i, (a, e) in enumerate(zip(actual, expected)):
            assert_all_close(a, e, atol, rtol, f"{msg}[{i}]")
        return
    np.testing.assert_allclose(np.asarray(actual), np.asarray(expected), atol=atol, rtol=rtol,
                               err_msg=msg)  # fmt: skip


def compare_results(with_ds, without_ds, partial_last_batch=None):
    """tf-keras's ``compare_results``, its tolerances unchanged (float32, on CPU)."""
    if partial_last_batch == "train_and_eval":
        tolerance = 1e-3
    else:
        tolerance = 4e-5
    assert sorted(with_ds) == sorted(without_ds)
    for key in sorted(with_ds):
        actual, expected = with_ds[key], without_ds[key]
        # tf-keras skips the loss with a partial last batch (its loss weighs that
        # batch's rows differently under a strategy).
        if partial_last_batch is not None:
            if key.startswith("eval_result"):
                actual, expected = actual[1:], expected[1:]
            if key.startswith("training_history"):
                actual = {**actual, "val_loss": 0}
                expected = {**expected, "val_loss": 0}
        assert_all_close(actual, expected, tolerance, tolerance, f"Fail to assert {key}.")


def run_correctness_test(
    test_model,
    strategy,
    use_numpy,
    use_validation_data,
    partial_last_batch=None,
    training_epochs=2,
):
    """tf-keras's ``run_correctness_test`` for a ``test_model`` with ``get_model`` and data."""
    np.random.seed(RANDOM_SEED)
    keras.utils.set_random_seed(RANDOM_SEED)
    if partial_last_batch == "eval":
        x_train, y_train, x_eval, y_eval, x_predict = test_model.data_with_partial_last_batch_eval()
    elif partial_last_batch == "train_and_eval":
        x_train, y_train, x_eval, y_eval, x_predict = test_model.data_with_partial_last_batch()
    else:
        x_train, y_train, x_predict = test_model.data()
        x_eval, y_eval = x_train, y_train
    # One set of initial weights for both runs.
    keras.utils.set_random_seed(WEIGHTS_SEED)
    initial_weights = test_model.get_model().get_weights()

    def inputs(with_strategy):
        return correctness_test_inputs(
            use_numpy, use_validation_data, with_strategy, x_train, y_train, x_eval, y_eval,
            x_predict, training_epochs,
        )  # fmt: skip

    with_ds = fit_eval_and_predict(initial_weights, inputs(strategy), test_model.get_model,
                                   strategy)  # fmt: skip
    without_ds = fit_eval_and_predict(initial_weights, inputs(None), test_model.get_model)
    compare_results(with_ds, without_ds, partial_last_batch)
    return with_ds


class LearningRateBatchScheduler(keras.callbacks.Callback):
    """Sets the optimizer's learning rate at the start of every batch."""

    def on_batch_begin(self, batch, logs=None):
        # To avoid divergence, limit the value range.
        self.model.optimizer.learning_rate.assign(0.001 * (batch % 10))


def run_dynamic_lr_test(test_model, strategy):
    """tf-keras's ``run_dynamic_lr_test``: a callback changes the learning rate every batch."""
    np.random.seed(RANDOM_SEED)
    keras.utils.set_random_seed(RANDOM_SEED)
    x_train, y_train, _ = test_model.data()
    keras.utils.set_random_seed(WEIGHTS_SEED)
    initial_weights = test_model.get_model().get_weights()

    def inputs():
        training = dict(x=x_train, y=y_train, batch_size=GLOBAL_BATCH_SIZE, shuffle=False,
                        epochs=2, callbacks=[LearningRateBatchScheduler()],
                        validation_data=(x_train, y_train))  # fmt: skip
        return training, None, None

    with_ds = fit_eval_and_predict(initial_weights, inputs(), test_model.get_model, strategy)
    without_ds = fit_eval_and_predict(initial_weights, inputs(), test_model.get_model)
    compare_results(with_ds, without_ds)
