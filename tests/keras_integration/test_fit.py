"""``model.fit`` / ``evaluate`` / ``predict`` under a strategy give one device's numbers.

Values and tolerances follow tf-keras's distribute tests (distribute_strategy_test,
keras_dnn_correctness_test): every distributed run is compared with
``OneDeviceStrategy("/cpu:0")`` started from the same weights.
"""

import contextlib

import jax
import keras
import numpy as np
import pytest
from conftest import cpus
from conftest import tpu_strategy

import keras_dist as kd
from keras_dist._values._variables import numpy_components

SEED = 1337
GLOBAL_BATCH = 64
# The float32 harness draws its initial weights with seed 0, not 1337. With
# Keras's seed-1337 weights a first-layer ReLU has its kink at x ~ 0.01, inside
# the data: rows near it switch sides on a last-bit difference, and after the
# fourth epoch the weights differ by 6.4e-5 (> 4e-5), with no error in the
# computation: in float64 the same run agrees to 1e-11
# (test_dnn_correctness_in_float64_differs_only_by_rounding). Seeds 0-11 all
# agree to better than 1e-7 beyond the tolerance.
WEIGHTS_SEED = 0


def _one_device():
    return kd.OneDeviceStrategy("/cpu:0")


def _assert_close(actual, expected, tol, what=""):
    actual_leaves = keras.tree.flatten(actual)
    expected_leaves = keras.tree.flatten(expected)
    assert len(actual_leaves) == len(expected_leaves), what
    for a, e in zip(actual_leaves, expected_leaves):
        np.testing.assert_allclose(np.asarray(a), np.asarray(e), atol=tol, rtol=tol, err_msg=what)


# --------------------------------------------------------------------------
# Spec 82: the DNN correctness harness (keras_dnn_correctness_test.py).


def _dnn(weights=None):
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
    if weights is not None:
        model.set_weights(weights)
    model.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse", metrics=["mse"])
    return model


def _fit_eval_and_predict(strategy, weights, data, epochs, use_validation_data):
    """tf-keras's ``fit_eval_and_predict``: fit, evaluate, predict, then fit and evaluate again."""
    x_train, y_train, x_eval, y_eval, x_predict = data
    with strategy.scope():
        model = _dnn(weights)
    fit_kwargs = dict(batch_size=GLOBAL_BATCH, epochs=epochs, shuffle=False, verbose=0)
    if use_validation_data:
        fit_kwargs["validation_data"] = (x_eval, y_eval)
    result = {}
    for run in (1, 2):
        result[f"training_history_{run}"] = model.fit(x_train, y_train, **fit_kwargs).history
        if not use_validation_data:
            result[f"eval_result_{run}"] = model.evaluate(
                x_eval, y_eval, batch_size=GLOBAL_BATCH, verbose=0
            )
        result[f"weights_{run}"] = model.get_weights()
        if run == 1:
            result["predict_result"] = model.predict(x_predict, verbose=0)
    return result


def _harness_data(partial_last_batch, dtype="float32"):
    np.random.seed(SEED)
    x_predict = np.array([[1.0], [2.0], [3.0], [4.0]], dtype=dtype)
    if partial_last_batch:
        x_train = np.random.rand(10000, 1).astype(dtype)
        x_eval = np.random.rand(10000, 1).astype(dtype)
        return x_train, 3 * x_train, x_eval, 3 * x_eval, x_predict
    x_train = np.random.rand(9984, 1).astype(dtype)
    return x_train, 3 * x_train, x_train, 3 * x_train, x_predict


@pytest.mark.parametrize(
    "partial_last_batch, use_validation_data",
    [(False, False), (True, True)],
    ids=["even-evaluate", "partial-validation"],
)
def test_dnn_correctness_matches_one_device(partial_last_batch, use_validation_data):
    data = _harness_data(partial_last_batch)
    keras.utils.set_random_seed(WEIGHTS_SEED)
    weights = _dnn().get_weights()
    # tf-keras: one epoch when the last batch is partial, two otherwise.
    epochs = 1 if partial_last_batch else 2
    mirrored = _fit_eval_and_predict(
        kd.MirroredStrategy(cpus(4)), weights, data, epochs, use_validation_data
    )
    one = _fit_eval_and_predict(_one_device(), weights, data, epochs, use_validation_data)
    tol = 1e-3 if partial_last_batch else 4e-5
    assert sorted(mirrored) == sorted(one)
    if use_validation_data:
        assert sorted(one["training_history_1"]) == ["loss", "mse", "val_loss", "val_mse"]
    for key in sorted(one):
        # Stricter than tf-keras, which skips the loss with a partial last batch
        # (its distributed loss weighs that batch's rows differently).
        _assert_close(mirrored[key], one[key], tol, what=key)


@pytest.fixture
def float64():
    floatx, policy = keras.config.floatx(), keras.config.dtype_policy()
    with jax.enable_x64(True):
        keras.config.set_floatx("float64")
        keras.config.set_dtype_policy("float64")
        try:
            yield
        finally:
            keras.config.set_floatx(floatx)
            keras.config.set_dtype_policy(policy)


def test_dnn_correctness_in_float64_differs_only_by_rounding(float64):
    # The even harness with seed-1337 weights (see WEIGHTS_SEED), in float64.
    data = _harness_data(False, "float64")
    keras.utils.set_random_seed(SEED)
    weights = _dnn().get_weights()
    assert weights[0].dtype == np.float64
    mirrored = _fit_eval_and_predict(kd.MirroredStrategy(cpus(4)), weights, data, 2, False)
    one = _fit_eval_and_predict(_one_device(), weights, data, 2, False)
    for key in sorted(one):
        _assert_close(mirrored[key], one[key], 1e-11, what=key)


# --------------------------------------------------------------------------
# Spec 83: metric correctness.


def _strategies():
    return [
        pytest.param(lambda: kd.MirroredStrategy(cpus(4)), id="mirrored4"),
        pytest.param(_one_device, id="one_device"),
    ]


@pytest.mark.parametrize("make_strategy", _strategies())
def test_simple_dnn_metric_correctness(make_strategy):
    np.random.seed(SEED)
    x = np.random.randint(0, 2, (10000, 1)).astype("float32")
    with make_strategy().scope():
        model = keras.Sequential(
            [keras.Input((1,)), keras.layers.Dense(1, kernel_initializer="ones")]
        )
        model.compile(
            optimizer=keras.optimizers.SGD(0.05),
            loss="mse",
            metrics=[keras.metrics.BinaryAccuracy()],
        )
    history = model.fit(x[:640], x[:640], batch_size=GLOBAL_BATCH, epochs=2, verbose=0)
    assert history.history["binary_accuracy"] == [1.0, 1.0]


@pytest.mark.parametrize("make_strategy", _strategies())
def test_identity_model_metric_eval_correctness(make_strategy):
    with make_strategy().scope():
        model = keras.Sequential(
            [
                keras.Input((4,)),
                keras.layers.Dense(3, activation="relu", kernel_initializer="ones"),
                keras.layers.Dense(1, activation="sigmoid", kernel_initializer="ones"),
            ]
        )
        model.compile(
            optimizer=keras.optimizers.SGD(0.001),
            loss="mae",
            metrics=["accuracy", keras.metrics.BinaryAccuracy()],
        )
    x = np.ones((40, 4), "float32")
    outs = model.evaluate(x, np.ones((40, 1), "float32"), batch_size=4, verbose=0)
    assert outs[1:] == [1.0, 1.0]
    outs = model.evaluate(x, np.zeros((40, 1), "float32"), batch_size=4, verbose=0)
    assert outs[1:] == [0.0, 0.0]


# --------------------------------------------------------------------------
# Spec 84: sample-weighted evaluate (distribute_strategy_test::test_numpy_with_sample_weights).

SAMPLE_X = np.array([[0], [1], [2], [3]], np.float32)
SAMPLE_Y = np.array([[2], [4], [6], [8]], np.float32)
SAMPLE_WEIGHTS = np.array([0.25, 0.5, 0.75, 1], np.float32)


@pytest.mark.parametrize("replicas", [1, 2, 4])
def test_evaluate_with_sample_weights(replicas):
    # batch_1 = ((2-0)^2 * 0.25 + (4-1)^2 * 0.5) / 2 = 2.75
    # batch_2 = ((6-2)^2 * 0.75 + (8-3)^2 * 1) / 2 = 18.5; (2.75 + 18.5) / 2 = 10.625.
    # On 4 replicas each batch of 2 gives two replicas one row and two none.
    with kd.MirroredStrategy(cpus(replicas)).scope():
        model = keras.Sequential(
            [
                keras.Input((1,)),
                keras.layers.Dense(1, kernel_initializer="ones", bias_initializer="zeros"),
            ]
        )
        model.compile(keras.optimizers.RMSprop(0.001), "mse")
    result = model.evaluate(
        SAMPLE_X, SAMPLE_Y, batch_size=2, sample_weight=SAMPLE_WEIGHTS, verbose=0
    )
    assert result == pytest.approx(10.625, rel=1e-6)
    # Without weights: (13 / 2 + 41 / 2) / 2 = 13.5.
    assert model.evaluate(SAMPLE_X, SAMPLE_Y, batch_size=2, verbose=0) == pytest.approx(
        13.5, rel=1e-6
    )


def test_fit_with_empty_replicas_matches_one_device():
    # Batches of 2, 2 and 1 rows on 4 replicas: every step leaves replicas without
    # rows; their loss counts as 0 (tf-keras), not NaN or an empty array.
    x = np.arange(5, dtype="float32").reshape(5, 1)
    weights = np.array([0.25, 0.5, 0.75, 1.0, 1.0], "float32")
    results = []
    for strategy in (kd.MirroredStrategy(cpus(4)), _one_device()):
        with strategy.scope():
            model = keras.Sequential(
                [keras.Input((1,)), keras.layers.Dense(1, kernel_initializer="ones")]
            )
            model.compile(keras.optimizers.SGD(0.1), "mse", metrics=["mae"])
        history = model.fit(
            x, 2 * x + 1, sample_weight=weights, batch_size=2, shuffle=False, verbose=0
        ).history
        results.append((history, model.get_weights()))
    assert np.isfinite(results[0][0]["loss"][0])
    _assert_close(results[0], results[1], 1e-6)


# --------------------------------------------------------------------------
# Spec 85: a regularization loss is counted once (test_regularizer_loss).


class _IdentityRegularizer(keras.regularizers.Regularizer):
    def __call__(self, x):
        return x


class _AddLayer(keras.layers.Layer):
    def build(self, _):
        self.v = self.add_weight(
            name="v", shape=(), initializer="ones", regularizer=_IdentityRegularizer()
        )

    def call(self, inputs):
        return inputs + self.v


@pytest.mark.parametrize("replicas", [1, 2])
def test_regularizer_loss_is_not_scaled_by_the_replica_count(engine, replicas):
    # Loss = x + v + v with x = 1: dLoss/dv = 2, so one SGD(1) step takes v from 1
    # to -1. Counting the regularizer once per replica would give -2 on 2 replicas.
    with kd.MirroredStrategy(cpus(replicas)).scope():
        x = keras.Input((1,), batch_size=2)
        model = keras.Model(x, _AddLayer()(x))
        model.compile(keras.optimizers.SGD(1.0), loss=lambda _, y_pred: keras.ops.mean(y_pred))
    ones = np.ones((2, 1), np.float32)
    model.fit(ones, ones, batch_size=2, verbose=0)
    assert model.get_weights()[0] == -1.0


# --------------------------------------------------------------------------
# Spec 88: steps_per_execution (test_host_training_loop*).


class _BatchCounter(keras.callbacks.Callback):
    def __init__(self):
        super().__init__()
        self.batches = {}

    def _record(self, key, batch):
        self.batches.setdefault(key, []).append(batch)

    def on_train_batch_begin(self, batch, logs=None):
        self._record("train_begin", batch)

    def on_train_batch_end(self, batch, logs=None):
        self._record("train_end", batch)

    def on_test_batch_begin(self, batch, logs=None):
        self._record("test_begin", batch)

    def on_test_batch_end(self, batch, logs=None):
        self._record("test_end", batch)

    def on_predict_batch_begin(self, batch, logs=None):
        self._record("predict_begin", batch)

    def on_predict_batch_end(self, batch, logs=None):
        self._record("predict_end", batch)


@pytest.mark.parametrize(
    "steps_per_execution, begins, ends",
    [
        (10, [0, 10, 20, 30, 40], [9, 19, 29, 39, 49]),
        # The last execution ends with the epoch (Keras 3 alone reports 59).
        (20, [0, 20, 40], [19, 39, 49]),
        # test_host_training_loop_truncate_to_epoch.
        (500, [0], [49]),
    ],
)
def test_steps_per_execution_calls_callbacks_per_execution(steps_per_execution, begins, ends):
    strategy = kd.MirroredStrategy(cpus(2))
    with strategy.scope():
        model = keras.Sequential([keras.Input((10,)), keras.layers.Dense(1)])
        model.compile("sgd", "mse", steps_per_execution=steps_per_execution)
    x, y = np.ones((100, 10), "float32"), np.ones((100, 1), "float32")
    counter = _BatchCounter()
    model.fit(x, y, batch_size=2, epochs=1, verbose=0, callbacks=[counter])
    model.evaluate(x, y, batch_size=2, verbose=0, callbacks=[counter])
    predictions = model.predict(x, batch_size=2, verbose=0, callbacks=[counter])
    for kind in ("train", "test", "predict"):
        assert counter.batches[f"{kind}_begin"] == begins, kind
        assert counter.batches[f"{kind}_end"] == ends, kind
    assert int(model.optimizer.iterations.numpy()) == 50
    assert predictions.shape == (100, 1)


# --------------------------------------------------------------------------
# Metrics: every metric, stateful ones included, is aggregated exactly.


def _classifier_data(rows, seed=3):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(rows, 4)).astype("float32")
    y = (x[:, :1] + 0.5 * x[:, 1:2] > 0).astype("float32")
    return x, y


def _classifier(weights=None, metrics=("accuracy",), run_eagerly=False):
    model = keras.Sequential(
        [
            keras.Input((4,)),
            keras.layers.Dense(8, activation="relu"),
            keras.layers.Dense(1, activation="sigmoid"),
        ]
    )
    if weights is not None:
        model.set_weights(weights)
    model.compile(
        optimizer=keras.optimizers.SGD(0.1),
        loss="binary_crossentropy",
        metrics=[m() if callable(m) else m for m in metrics],
        run_eagerly=run_eagerly,
    )
    return model


def _initial_weights():
    keras.utils.set_random_seed(SEED)
    return _classifier().get_weights()


def _in_scope(strategy, make_model, *args, **kwargs):
    with strategy.scope():
        return make_model(*args, **kwargs)


STATEFUL_METRICS = (
    "accuracy",
    lambda: keras.metrics.AUC(name="auc"),
    lambda: keras.metrics.Precision(name="precision"),
    lambda: keras.metrics.Recall(name="recall"),
    # A Mean of a per-row value (MeanMetricWrapper is a keras.metrics.Mean).
    lambda: keras.metrics.MeanMetricWrapper(lambda y, p: keras.ops.abs(y - p), name="mean"),
)


@pytest.mark.parametrize("one_program", [True, False], ids=["one_program", "per_replica"])
def test_metrics_are_aggregated_exactly_with_a_partial_last_batch(one_program, monkeypatch):
    # 70 rows in batches of 16: the last batch (6 rows) splits 2, 2, 1, 1. On CPU it runs
    # as one program of every replica; on accelerators as one program per replica shape.
    from keras_dist._keras_steps import _steps

    monkeypatch.setattr(_steps, "uneven_in_one_program", lambda extended: one_program)
    x, y = _classifier_data(70)
    weights = _initial_weights()
    results = []
    for strategy in (kd.MirroredStrategy(cpus(4)), _one_device()):
        model = _in_scope(strategy, _classifier, weights, STATEFUL_METRICS)
        history = model.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0).history
        evaluation = model.evaluate(x, y, batch_size=16, verbose=0, return_dict=True)
        results.append((history, evaluation, model.get_weights()))
    (history, evaluation, weights_after), expected = results[0], results[1]
    assert sorted(evaluation) == ["accuracy", "auc", "loss", "mean", "precision", "recall"]
    _assert_close(history, expected[0], 1e-6, "history")
    _assert_close(evaluation, expected[1], 1e-6, "evaluate")
    _assert_close(weights_after, expected[2], 1e-6, "weights")
    # Not a trivial comparison: the metrics are neither 0 nor 1.
    for name in ("accuracy", "auc", "precision", "recall"):
        assert 0.0 < evaluation[name] < 1.0, name


# --------------------------------------------------------------------------
# Keras features under MirroredStrategy equal one device's (and plain Keras's).


class _LogRecorder(keras.callbacks.Callback):
    def __init__(self):
        super().__init__()
        self.batch_logs = []
        self.epoch_logs = []

    def on_train_batch_end(self, batch, logs=None):
        self.batch_logs.append(dict(logs))

    def on_epoch_end(self, epoch, logs=None):
        self.epoch_logs.append(dict(logs))


def _fit_with_features(strategy, weights, rows=38, run_eagerly=False, second_fit=True):
    """Two fits: class weights inside the scope, then sample weights outside it.

    ``strategy=None`` is plain Keras. With 38 rows in batches of 16 the last
    batch (6 rows) splits unevenly between 4 replicas; the validation data
    (10 rows in batches of 4) ends with 2 rows.
    """
    x, y = _classifier_data(rows)
    x_val, y_val = _classifier_data(10, seed=4)
    sample_weight = np.linspace(0.5, 1.5, rows).astype("float32")
    kwargs = dict(
        batch_size=16,
        validation_batch_size=4,
        epochs=2,
        shuffle=False,
        verbose=0,
        validation_data=(x_val, y_val),
    )
    if strategy is None:
        model = _classifier(weights, run_eagerly=run_eagerly)
        scope = contextlib.nullcontext()
    else:
        model = _in_scope(strategy, _classifier, weights, run_eagerly=run_eagerly)
        scope = strategy.scope()
    first = _LogRecorder()
    with scope:
        history = model.fit(x, y, class_weight={0: 0.5, 1: 2.0}, callbacks=[first], **kwargs)
    result = {"history": history.history}
    if second_fit:
        # Outside the scope: the model's own strategy runs it.
        second = model.fit(x, y, sample_weight=sample_weight, **kwargs)
        result["second_history"] = second.history
    return result | {
        "batch_logs": first.batch_logs,
        "epoch_logs": first.epoch_logs,
        "weights": model.get_weights(),
    }


def test_fit_features_match_one_device():
    weights = _initial_weights()
    mirrored = _fit_with_features(kd.MirroredStrategy(cpus(4)), weights)
    one = _fit_with_features(_one_device(), weights)
    plain = _fit_with_features(None, weights)
    history = mirrored["history"]
    assert sorted(history) == ["accuracy", "loss", "val_accuracy", "val_loss"]
    assert all(len(v) == 2 for v in history.values())
    # 38 rows in batches of 16: 3 steps an epoch, 2 epochs.
    assert len(mirrored["batch_logs"]) == 6
    assert sorted(mirrored["batch_logs"][-1]) == ["accuracy", "loss"]
    for epoch in range(2):
        _assert_close(
            mirrored["epoch_logs"][epoch], {k: v[epoch] for k, v in history.items()}, 0, "logs"
        )
    for key in one:
        _assert_close(mirrored[key], one[key], 1e-6, key)
        # One device is plain Keras: the class and sample weights are really used.
        _assert_close(one[key], plain[key], 1e-6, key)


def test_run_eagerly_gives_the_compiled_numbers():
    # Kept small: the eager engine compiles every op for every device and shape once.
    weights = _initial_weights()
    kwargs = dict(rows=21, second_fit=False)
    compiled = _fit_with_features(kd.MirroredStrategy(cpus(2)), weights, **kwargs)
    eager = _fit_with_features(kd.MirroredStrategy(cpus(2)), weights, run_eagerly=True, **kwargs)
    for key in compiled:
        _assert_close(eager[key], compiled[key], 1e-6, key)


# --------------------------------------------------------------------------
# predict: one output row per input row.


@pytest.mark.parametrize("rows, batch_size", [(10, 4), (3, 4), (1, 8), (13, 5)])
def test_predict_returns_one_row_per_input(rows, batch_size):
    x = np.arange(rows * 4, dtype="float32").reshape(rows, 4) / 10
    weights = _initial_weights()
    mirrored = _in_scope(kd.MirroredStrategy(cpus(4)), _classifier, weights)
    one = _in_scope(_one_device(), _classifier, weights)
    predictions = mirrored.predict(x, batch_size=batch_size, verbose=0)
    assert predictions.shape == (rows, 1)
    # Equal up to rounding: the padded batch is a program of another shape.
    expected = one.predict(x, batch_size=batch_size, verbose=0)
    np.testing.assert_allclose(predictions, expected, rtol=1e-6)
    np.testing.assert_allclose(mirrored.predict_on_batch(x), expected, rtol=1e-6)


class _PredictedRows(keras.callbacks.Callback):
    def __init__(self):
        super().__init__()
        self.rows = []
        self.kinds = set()

    def on_predict_batch_end(self, batch, logs=None):
        self.rows.append(np.asarray(logs["outputs"]).shape[0])
        self.kinds.add(isinstance(logs["outputs"], jax.Array))


@pytest.mark.parametrize("steps_per_execution", [1, 3])
@pytest.mark.parametrize(
    "make_strategy",
    [_one_device, lambda: kd.MirroredStrategy(cpus(1)), lambda: tpu_strategy(1, 2)],
    ids=["one device", "mirrored, one device", "tpu, one replica of 2 cores"],
)
def test_one_replicas_predict_equals_plain_keras_batch_by_batch(make_strategy, steps_per_execution):
    # One replica's outputs stay on its device until Keras joins them (as plain
    # Keras's do); each batch's, the padded last one's too, has that batch's rows,
    # and callbacks get them as they get plain Keras's.
    x = np.arange(13 * 4, dtype="float32").reshape(13, 4) / 10
    weights = _initial_weights()

    def classifier():
        model = _classifier(weights)
        model.compile("sgd", "binary_crossentropy", steps_per_execution=steps_per_execution)
        return model

    plain = classifier()
    model = _in_scope(make_strategy(), classifier)
    expected_rows, rows = _PredictedRows(), _PredictedRows()
    expected = plain.predict(x, batch_size=4, verbose=0, callbacks=[expected_rows])
    predictions = model.predict(x, batch_size=4, verbose=0, callbacks=[rows])
    assert isinstance(predictions, np.ndarray) and predictions.shape == (13, 1)
    np.testing.assert_allclose(predictions, expected, rtol=1e-6)
    assert rows.kinds == expected_rows.kinds  # callbacks see what plain Keras's see
    assert (
        rows.rows == expected_rows.rows == ([4, 4, 4, 1] if steps_per_execution == 1 else [12, 1])
    )


# --------------------------------------------------------------------------
# A model built outside any scope.


def test_model_built_outside_any_scope_cannot_be_trained_inside_one():
    model = _classifier()
    x, y = _classifier_data(8)
    strategy = kd.MirroredStrategy(cpus(2))
    with strategy.scope():
        for call in (
            lambda: model.fit(x, y, verbose=0),
            lambda: model.evaluate(x, y, verbose=0),
            lambda: model.predict(x, verbose=0),
        ):
            with pytest.raises(ValueError, match="outside any strategy scope") as info:
                call()
            assert "strategy.scope()" in str(info.value)
            assert "Received:" in str(info.value)
    # Outside the scope it is an ordinary Keras model.
    assert model.fit(x, y, verbose=0).history["loss"]


# --------------------------------------------------------------------------
# Batch normalization keeps per-replica statistics (tf.keras's ON_READ / MEAN).


def test_batch_norm_statistics_are_per_replica_and_read_as_their_mean():
    strategy = kd.MirroredStrategy(cpus(2))
    with strategy.scope():
        model = keras.Sequential([keras.Input((1,)), keras.layers.BatchNormalization()])
        model.compile(keras.optimizers.SGD(0.0), "mse")
    layer = model.layers[0]
    assert isinstance(layer.moving_mean, kd.SyncOnReadVariable)
    assert layer.moving_mean.aggregation == "mean"
    # Replica 0 sees [0, 2] (mean 1, variance 1), replica 1 [10, 12] (mean 11, variance 1).
    x = np.array([[0.0], [2.0], [10.0], [12.0]], "float32")
    model.fit(x, x, batch_size=4, epochs=1, shuffle=False, verbose=0)
    momentum = layer.momentum  # moving = moving * momentum + batch * (1 - momentum)
    mean_components = numpy_components(layer.moving_mean)
    np.testing.assert_allclose(
        np.ravel(mean_components), [(1 - momentum) * 1.0, (1 - momentum) * 11.0], rtol=1e-5
    )
    np.testing.assert_allclose(layer.moving_mean.numpy(), [(1 - momentum) * 6.0], rtol=1e-5)
    # Per-replica variances are 1 (a synchronized batch would have variance 26).
    np.testing.assert_allclose(np.ravel(numpy_components(layer.moving_variance)), [1.0, 1.0])
    np.testing.assert_allclose(layer.moving_variance.numpy(), [1.0], rtol=1e-6)


class _MeanActivityLoss(keras.layers.Layer):
    def call(self, h):
        self.add_loss(0.01 * keras.ops.mean(keras.ops.abs(h)))
        return h


class _OwnLossModel(keras.Sequential):
    def compute_loss(self, x=None, y=None, y_pred=None, sample_weight=None, training=True):
        loss = super().compute_loss(x, y, y_pred, sample_weight, training=training)
        return loss + 0.01 * keras.ops.mean(keras.ops.square(y_pred))


@pytest.mark.parametrize("kind", ["add_loss_of_a_mean", "compute_loss_override"])
def test_a_replica_without_rows_adds_nothing_to_a_mean_based_loss(kind):
    # 18 rows in batches of 16: the last 2 rows leave two of four replicas none; a mean
    # over no rows is NaN, and the reported loss was NaN.
    x = np.random.default_rng(0).normal(size=(18, 5)).astype("float32")
    y = x[:, :1]

    def build():
        keras.utils.set_random_seed(0)
        cls = _OwnLossModel if kind == "compute_loss_override" else keras.Sequential
        layers = [keras.Input((5,)), keras.layers.Dense(4)]
        layers += [_MeanActivityLoss()] if kind == "add_loss_of_a_mean" else []
        model = cls([*layers, keras.layers.Dense(1)])
        model.compile(optimizer="sgd", loss="mse")
        return model

    results = []
    for strategy in (kd.MirroredStrategy(cpus(4)), None):
        with strategy.scope() if strategy else contextlib.nullcontext():
            model = build()
        history = model.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0).history
        results.append((history["loss"], model.evaluate(x, y, batch_size=16, verbose=0)))
        results[-1] += (model.get_weights(),)
    (losses, evaluated, weights), (plain_losses, plain_evaluated, plain_weights) = results
    np.testing.assert_allclose(losses, plain_losses, rtol=1e-5)
    np.testing.assert_allclose(evaluated, plain_evaluated, rtol=1e-5)
    for ours, theirs in zip(weights, plain_weights):
        np.testing.assert_allclose(ours, theirs, rtol=1e-5, atol=1e-6)


def test_a_batch_size_the_replicas_cannot_share_evenly_warns_once():
    import warnings

    from keras_dist._keras_steps._uneven_batches import UnevenBatchWarning

    x = np.random.default_rng(0).normal(size=(100, 4)).astype("float32")
    y = x[:, :1]
    strategy = kd.MirroredStrategy(cpus(4))
    caught = {}
    for batch_size in (32, 30):  # 100 rows: a partial last batch of 4, or every batch uneven
        with strategy.scope():
            model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
            model.compile(optimizer="sgd", loss="mse")
        with warnings.catch_warnings(record=True) as records:
            warnings.simplefilter("always")
            model.fit(x, y, batch_size=batch_size, epochs=3, verbose=0)
        caught[batch_size] = [r for r in records if issubclass(r.category, UnevenBatchWarning)]
    assert caught[32] == []
    (warning,) = caught[30]
    assert "30 rows" in str(warning.message) and "multiple of 4 (28 or 32)" in str(warning.message)


def test_fit_evaluate_and_predict_take_a_distributed_dataset_as_tf():
    # TF's Keras takes the datasets of experimental_distribute_dataset and
    # distribute_datasets_from_function (Keras refused them: "Unrecognized data type").
    rng = np.random.default_rng(0)
    x = rng.normal(size=(40, 3)).astype("float32")
    y = x.sum(axis=1, keepdims=True)
    strategy = kd.MirroredStrategy(cpus(2))
    batches = strategy.experimental_make_numpy_dataset((x, y)).batch(8)

    def per_replica_batches(context):  # replica i's half of each global batch of 8
        size = context.get_per_replica_batch_size(8)
        return [(x[s : s + size], y[s : s + size]) for s in range(0, 40, size)]

    distributed = {
        "from a dataset": strategy.experimental_distribute_dataset(batches),
        "from a function": strategy.distribute_datasets_from_function(per_replica_batches),
    }
    results = {}
    for name, data in {"plain": batches, **distributed}.items():
        keras.utils.set_random_seed(1)
        with strategy.scope():
            model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
            model.compile("sgd", "mse", metrics=["mae"])
        validation = distributed["from a dataset"] if name != "plain" else batches
        history = model.fit(data, validation_data=validation, epochs=2, verbose=0).history
        results[name] = (history, model.evaluate(data, verbose=0), model.predict(data, verbose=0))
    expected_history, expected_scores, expected_predictions = results["plain"]
    assert len(expected_history["loss"]) == 2 and expected_predictions.shape == (40, 1)
    for name in distributed:
        history, scores, predictions = results[name]
        # The same global batches, each split and joined again: the same numbers up to
        # the rounding of a sum over two replicas.
        for key in ("loss", "mae", "val_loss", "val_mae"):
            np.testing.assert_allclose(history[key], expected_history[key], rtol=1e-5)
        np.testing.assert_allclose(scores, expected_scores, rtol=1e-5)
        np.testing.assert_allclose(predictions, expected_predictions, rtol=1e-5, atol=1e-6)


def test_a_replica_without_rows_leaves_its_batch_norm_statistics_as_they_are():
    # 33 rows in batches of 16 on 4 replicas: the last batch's one row goes to replica 0
    # and the other three have none. Their moments over 0 rows were NaN, and so became
    # the moving statistics and every later prediction. As tf.keras: they stay as they were.
    rng = np.random.default_rng(0)
    x = rng.normal(size=(33, 4)).astype("float32")
    y = rng.normal(size=(33, 1)).astype("float32")
    strategy = kd.MirroredStrategy(cpus(4))
    with strategy.scope():
        model = keras.Sequential(
            [keras.Input((4,)), keras.layers.BatchNormalization(), keras.layers.Dense(1)]
        )
        model.compile("sgd", "mse")
    model.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0)
    bn = model.layers[0]
    # Each replica's own moving statistics (momentum 0.99), read as their mean.
    means, variances = np.zeros((4, 4)), np.ones((4, 4))
    pieces = [[x[s + 4 * r : s + 4 * r + 4] for r in range(4)] for s in (0, 16)]
    pieces.append([x[32:33], None, None, None])
    for step in pieces:
        for r, rows in enumerate(step):
            if rows is not None:
                means[r] = 0.99 * means[r] + 0.01 * rows.mean(axis=0)
                variances[r] = 0.99 * variances[r] + 0.01 * rows.var(axis=0)
    np.testing.assert_allclose(bn.moving_mean.numpy(), means.mean(axis=0), atol=1e-6)
    np.testing.assert_allclose(bn.moving_variance.numpy(), variances.mean(axis=0), atol=1e-6)
    assert np.all(np.isfinite(model.predict(x, verbose=0)))
