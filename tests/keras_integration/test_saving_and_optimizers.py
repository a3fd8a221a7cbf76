"""Saving, checkpoint callbacks and optimizer features of ``model.fit`` under a strategy.

Every expected value comes from the same model, with the same initial weights
(one ``keras.utils.set_random_seed`` before each build), trained on one device.

Not covered: spec 86's "gradient transformer that sets grads to 1". tf.keras
optimizers took ``gradient_transformers=[fn]`` (run after the cross-replica
aggregation); Keras 3 optimizers have no such argument nor a public hook in
its place (only the built-in ``clipnorm`` / ``clipvalue`` / ``global_clipnorm``,
tested here, and private methods such as ``_clip_gradients``).
"""

import contextlib
import math

import keras
import numpy as np
import pytest
from conftest import cpus

import keras_dist as kd
from keras_dist._values._variables import numpy_components

X = np.random.RandomState(0).rand(32, 3).astype("float32")
Y = X.sum(axis=1, keepdims=True)
FIT = dict(batch_size=8, verbose=0, shuffle=False)


def _scope(strategy):
    return strategy.scope() if strategy is not None else contextlib.nullcontext()


def _model(
    strategy,
    *,
    batch_norm=False,
    optimizer=None,
    output_dtype=None,
    build_optimizer=False,
    **compile_kwargs,
):
    """Dense(8, relu) [-> BatchNormalization] -> Dense(1), mse, an "mae" metric; seed 1.

    ``optimizer`` is a function making it: an optimizer creates its iteration
    counter when constructed, so it must be constructed in the scope too.
    ``build_optimizer`` creates its slots now (in the scope), so that
    ``load_weights`` restores them too.
    """
    keras.utils.set_random_seed(1)
    with _scope(strategy):
        layers = [keras.Input((3,)), keras.layers.Dense(8, activation="relu")]
        if batch_norm:
            layers.append(keras.layers.BatchNormalization())
        layers.append(keras.layers.Dense(1, dtype=output_dtype))
        model = keras.Sequential(layers)
        if optimizer is None:
            optimizer = keras.optimizers.SGD(0.05, momentum=0.9)
        else:
            optimizer = optimizer()
        model.compile(optimizer=optimizer, loss="mse", metrics=["mae"], **compile_kwargs)
        if build_optimizer:
            model.optimizer.build(model.trainable_variables)
    return model


def _assert_same_weights(a, b, atol=0.0):
    wa, wb = a.get_weights(), b.get_weights()
    assert len(wa) == len(wb)
    for x, y in zip(wa, wb):
        np.testing.assert_allclose(x, y, rtol=0, atol=atol)


def _optimizer_state(model):
    return [np.asarray(v.value) for v in model.optimizer.variables]


def _iterations(model):
    return int(keras.ops.convert_to_numpy(model.optimizer.iterations))


def _assert_distributed(model, strategy):
    variables = list(model.variables) + list(model.optimizer.variables)
    for v in variables:
        assert isinstance(v, (kd.MirroredVariable, kd.SyncOnReadVariable)), v.path
        assert v.distribute_strategy is strategy, v.path


# ------------------------------------------------------------------- saving
@pytest.mark.parametrize("load_under", ["no_strategy", "one_device"])
def test_keras_file_saved_under_mirrored_loads_on_one_device(tmp_path, load_under):
    strategy = kd.MirroredStrategy(cpus(4))
    model = _model(strategy)
    model.fit(X, Y, epochs=2, **FIT)
    path = str(tmp_path / "m.keras")
    model.save(path)

    one_device = kd.OneDeviceStrategy("/cpu:0") if load_under == "one_device" else None
    with _scope(one_device):
        loaded = keras.models.load_model(path)
    if one_device is None:
        assert not any(isinstance(v, kd.MirroredVariable) for v in loaded.variables)
    else:
        _assert_distributed(loaded, one_device)

    # The stored values are the model's: weights and optimizer state (momentum
    # slots, iterations) exactly, predictions to float rounding of the split batch.
    _assert_same_weights(model, loaded)
    assert _iterations(loaded) == _iterations(model) == 8
    for a, b in zip(_optimizer_state(model), _optimizer_state(loaded)):
        np.testing.assert_array_equal(a, b)
    np.testing.assert_allclose(
        loaded.predict(X, verbose=0), model.predict(X, verbose=0), rtol=0, atol=1e-6
    )
    # The compiled loss and metric come back and agree with the distributed model's.
    expected = model.evaluate(X, Y, verbose=0, return_dict=True)
    got = loaded.evaluate(X, Y, verbose=0, return_dict=True)
    assert set(got) == set(expected) == {"loss", "mae"}
    for key in expected:
        np.testing.assert_allclose(got[key], expected[key], rtol=1e-5, atol=1e-6)


def test_keras_file_saved_on_one_device_loads_distributed(tmp_path):
    model = _model(None)
    model.fit(X, Y, epochs=2, **FIT)
    path = str(tmp_path / "m.keras")
    model.save(path)

    strategy = kd.MirroredStrategy(cpus(4))
    with strategy.scope():
        loaded = keras.models.load_model(path)
    _assert_distributed(loaded, strategy)
    for v, saved in zip(loaded.trainable_variables, model.trainable_variables):
        assert isinstance(v, kd.MirroredVariable)
        # One replicated value: every replica's copy is the saved one.
        for component in numpy_components(v):
            np.testing.assert_array_equal(component, np.asarray(saved.value))
    _assert_same_weights(model, loaded)
    assert _iterations(loaded) == 8
    np.testing.assert_allclose(
        loaded.predict(X, verbose=0), model.predict(X, verbose=0), rtol=0, atol=1e-6
    )
    # The optimizer state (momentum) was restored too: one more epoch on each
    # gives the same weights.
    model.fit(X, Y, epochs=1, **FIT)
    loaded.fit(X, Y, epochs=1, **FIT)
    _assert_same_weights(model, loaded, atol=1e-6)
    assert _iterations(loaded) == _iterations(model) == 12


def test_batch_norm_statistics_are_saved_as_the_mean_of_the_replicas(tmp_path):
    strategy = kd.MirroredStrategy(cpus(4))
    model = _model(strategy, batch_norm=True)
    model.fit(X, Y, epochs=2, **FIT)
    bn = model.layers[1]
    assert isinstance(bn.moving_mean, kd.SyncOnReadVariable)
    assert bn.moving_mean.aggregation == "mean"
    means = numpy_components(bn.moving_mean)
    variances = numpy_components(bn.moving_variance)
    # Each replica normalized its own quarter of the batch: different statistics.
    assert np.abs(variances[0] - variances[1]).max() > 1e-4

    keras_path, weights_path = str(tmp_path / "m.keras"), str(tmp_path / "w.weights.h5")
    model.save(keras_path)
    model.save_weights(weights_path)
    loaded = keras.models.load_model(keras_path)
    from_weights = _model(None, batch_norm=True, build_optimizer=True)
    from_weights.load_weights(weights_path)
    for restored in (loaded, from_weights):
        restored_bn = restored.layers[1]
        np.testing.assert_allclose(
            np.asarray(restored_bn.moving_mean.value), np.mean(means, axis=0), rtol=1e-6
        )
        np.testing.assert_allclose(
            np.asarray(restored_bn.moving_variance.value), np.mean(variances, axis=0), rtol=1e-6
        )
        _assert_same_weights(restored, model)  # get_weights reads the aggregate too

    # Loading under the strategy gives every replica the saved (mean) statistics,
    # so the distributed predictions equal one device's.
    with strategy.scope():
        reloaded = keras.models.load_model(keras_path)
    _assert_distributed(reloaded, strategy)
    for component in numpy_components(reloaded.layers[1].moving_variance):
        np.testing.assert_allclose(component, np.mean(variances, axis=0), rtol=1e-6)
    expected = loaded.predict(X, verbose=0)
    np.testing.assert_allclose(reloaded.predict(X, verbose=0), expected, rtol=0, atol=1e-6)
    np.testing.assert_allclose(from_weights.predict(X, verbose=0), expected, rtol=0, atol=1e-6)


def test_save_weights_and_load_weights_across_strategies(tmp_path):
    strategy = kd.MirroredStrategy(cpus(4))
    distributed = _model(strategy)
    distributed.fit(X, Y, epochs=2, **FIT)
    path = str(tmp_path / "distributed.weights.h5")
    distributed.save_weights(path)

    for one_device in (None, kd.OneDeviceStrategy("/cpu:0")):
        restored = _model(one_device, build_optimizer=True)
        restored.load_weights(path)
        _assert_same_weights(restored, distributed)
        assert _iterations(restored) == 8
        for a, b in zip(_optimizer_state(restored), _optimizer_state(distributed)):
            np.testing.assert_array_equal(a, b)
        np.testing.assert_allclose(
            restored.predict(X, verbose=0), distributed.predict(X, verbose=0), rtol=0, atol=1e-6
        )

    # And back: weights trained on one device into a model built in the scope.
    single = _model(None)
    single.fit(X, Y, epochs=1, **FIT)
    path = str(tmp_path / "single.weights.h5")
    single.save_weights(path)
    restored = _model(strategy, build_optimizer=True)
    restored.load_weights(path)
    _assert_distributed(restored, strategy)
    _assert_same_weights(restored, single)
    for a, b in zip(_optimizer_state(restored), _optimizer_state(single)):
        np.testing.assert_array_equal(a, b)
    np.testing.assert_allclose(
        restored.predict(X, verbose=0), single.predict(X, verbose=0), rtol=0, atol=1e-6
    )


def test_model_checkpoint_under_mirrored(tmp_path):
    strategy = kd.MirroredStrategy(cpus(4))
    model = _model(strategy, batch_norm=True)
    callbacks = [
        keras.callbacks.ModelCheckpoint(str(tmp_path / "epoch_{epoch}.keras")),
        keras.callbacks.ModelCheckpoint(
            str(tmp_path / "best.weights.h5"),
            save_weights_only=True,
            save_best_only=True,
            monitor="mae",
        ),
    ]
    history = model.fit(X, Y, epochs=3, callbacks=callbacks, **FIT)
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "best.weights.h5",
        "epoch_1.keras",
        "epoch_2.keras",
        "epoch_3.keras",
    ]
    assert np.argmin(history.history["mae"]) == 2  # so "best" is the last epoch

    last = keras.models.load_model(str(tmp_path / "epoch_3.keras"))
    _assert_same_weights(last, model)
    assert _iterations(last) == 12
    best = _model(strategy, batch_norm=True, build_optimizer=True)
    best.load_weights(str(tmp_path / "best.weights.h5"))
    _assert_distributed(best, strategy)
    _assert_same_weights(best, model)

    # The first epoch's file holds the first epoch's weights: one epoch from the
    # same start gives them.
    first = keras.models.load_model(str(tmp_path / "epoch_1.keras"))
    one_epoch = _model(strategy, batch_norm=True)
    one_epoch.fit(X, Y, epochs=1, **FIT)
    _assert_same_weights(first, one_epoch)


class _InterruptAtEpoch(keras.callbacks.Callback):
    def __init__(self, epoch):
        super().__init__()
        self.epoch = epoch

    def on_epoch_begin(self, epoch, logs=None):
        if epoch == self.epoch:
            raise RuntimeError(f"Interrupted at epoch {epoch}")


class _EpochsSeen(keras.callbacks.Callback):
    def __init__(self):
        super().__init__()
        self.epochs = []

    def on_epoch_begin(self, epoch, logs=None):
        self.epochs.append(epoch)


def test_backup_and_restore_resumes_an_interrupted_fit(tmp_path):
    strategy = kd.MirroredStrategy(cpus(4))
    uninterrupted = _model(strategy, batch_norm=True)
    uninterrupted.fit(X, Y, epochs=4, **FIT)

    backup_dir = str(tmp_path / "backup")
    interrupted = _model(strategy, batch_norm=True)
    with pytest.raises(RuntimeError, match="Interrupted at epoch 2"):
        interrupted.fit(
            X,
            Y,
            epochs=4,
            callbacks=[keras.callbacks.BackupAndRestore(backup_dir), _InterruptAtEpoch(2)],
            **FIT,
        )

    resumed = _model(strategy, batch_norm=True)  # a fresh process would rebuild it
    seen = _EpochsSeen()
    resumed.fit(
        X, Y, epochs=4, callbacks=[keras.callbacks.BackupAndRestore(backup_dir), seen], **FIT
    )
    assert seen.epochs[0] >= 2
    assert seen.epochs == [2, 3]
    _assert_distributed(resumed, strategy)
    assert _iterations(resumed) == _iterations(uninterrupted) == 16
    # The batch-norm statistics were restored as the replicas' mean (as TF's
    # checkpoints): the moving averages (linear) then match to rounding.
    _assert_same_weights(resumed, uninterrupted, atol=1e-6)
    for a, b in zip(_optimizer_state(resumed), _optimizer_state(uninterrupted)):
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-6)


# ------------------------------------------------------ gradient clipping (86)
class _Difference(keras.layers.Layer):
    """Outputs ``3 * v1 - 3 * v2`` for every row; v1 = v2 = 1 at the start."""

    def build(self, input_shape):
        self.v1 = self.add_weight(shape=(), initializer="ones", name="v1")
        self.v2 = self.add_weight(shape=(), initializer="ones", name="v2")

    def call(self, x):
        return keras.ops.zeros_like(x) + 3.0 * self.v1 - 3.0 * self.v2


_STRATEGIES = {
    "one_device": lambda: kd.OneDeviceStrategy("/cpu:0"),
    "mirrored_2": lambda: kd.MirroredStrategy(cpus(2)),
    "mirrored_4": lambda: kd.MirroredStrategy(cpus(4)),
}


def _fit_difference(strategy, rows, **clip):
    with strategy.scope():
        layer = _Difference()
        model = keras.Sequential([keras.Input((1,)), layer])
        model.compile(keras.optimizers.SGD(1.0, **clip), "mae")
    ones = np.ones((rows, 1), "float32")
    model.fit(ones, ones, batch_size=rows, epochs=1, verbose=0)
    return float(layer.v1.value), float(layer.v2.value)


@pytest.mark.parametrize("clip", ["clipnorm", "clipvalue"])
@pytest.mark.parametrize(
    "name, rows",
    [("one_device", 10), ("mirrored_2", 10), ("mirrored_4", 8), ("mirrored_4", 10)],
)
def test_gradient_clipping_applies_to_the_aggregated_gradient(name, rows, clip):
    # mae of 0 against 1: gradients -3 and +3, clipped to -2 and +2 -> v1 = 3, v2 = -1.
    # Clipping each replica's share (-3/n, 3/n) instead would not clip at all
    # (v1 = 4, v2 = -2). Keras 3 allows one of clipnorm/clipvalue at a time.
    v1, v2 = _fit_difference(_STRATEGIES[name](), rows, **{clip: 2.0})
    # Within float rounding: the mean over 10 rows of mae's gradient is not
    # exactly -1 in float32 (plain Keras also gives v1 = 3.0000002 there).
    np.testing.assert_allclose([v1, v2], [3.0, -1.0], rtol=0, atol=1e-6)


@pytest.mark.parametrize("name", ["one_device", "mirrored_2", "mirrored_4"])
def test_global_clipnorm_applies_to_the_aggregated_gradient(name):
    # Gradients (-3, 3) have global norm 3*sqrt(2); scaled to norm 2: (-sqrt(2), sqrt(2)).
    # Per replica (2 replicas: norm 1.5*sqrt(2) each, both clipped) would give 2*sqrt(2).
    v1, v2 = _fit_difference(_STRATEGIES[name](), 8, global_clipnorm=2.0)
    np.testing.assert_allclose([v1, v2], [1 + math.sqrt(2), 1 - math.sqrt(2)], rtol=1e-6)


# ---------------------------------------------------------- mixed precision
@pytest.fixture
def dtype_policy(request):
    keras.mixed_precision.set_dtype_policy(request.param)
    yield request.param
    keras.mixed_precision.set_dtype_policy("float32")


@pytest.mark.parametrize("dtype_policy", ["mixed_bfloat16", "mixed_float16"], indirect=True)
def test_mixed_precision_fit_matches_one_device(dtype_policy):
    results = {}
    for name, strategy in [
        ("one_device", kd.OneDeviceStrategy("/cpu:0")),
        ("mirrored", kd.MirroredStrategy(cpus(4))),
    ]:
        # A float32 output layer, as Keras recommends. With a float16 one the
        # one-device gradient of the scaled loss overflows float16 at Keras's
        # initial scale (2**15) and that step is skipped, while each replica's
        # gradient (of 1/4 of the loss) does not: a legitimate difference.
        model = _model(
            strategy, optimizer=lambda: keras.optimizers.SGD(0.05), output_dtype="float32"
        )
        assert model.layers[0].compute_dtype == dtype_policy.removeprefix("mixed_")
        assert all(v.dtype == "float32" for v in model.trainable_variables)
        # Keras wraps the optimizer in a LossScaleOptimizer for float16 only.
        wrapped = isinstance(model.optimizer, keras.optimizers.LossScaleOptimizer)
        assert wrapped == (dtype_policy == "mixed_float16")
        history = model.fit(X, Y, epochs=2, **FIT)
        _assert_distributed(model, strategy)
        results[name] = (
            model.get_weights(),
            model.predict(X, verbose=0),
            history.history,
            _iterations(model),
            float(model.optimizer.dynamic_scale.value) if wrapped else None,
        )
    (w1, p1, h1, i1, s1), (w4, p4, h4, i4, s4) = results["one_device"], results["mirrored"]
    assert i1 == i4 == 8
    assert s1 == s4 == (None if dtype_policy == "mixed_bfloat16" else 2.0**15)
    for a, b in zip(w1, w4):
        assert np.all(np.isfinite(b))
        np.testing.assert_allclose(b, a, rtol=1e-2, atol=1e-2)
    assert np.all(np.isfinite(p4))
    np.testing.assert_allclose(p4, p1, rtol=1e-2, atol=1e-2)
    for key in ("loss", "mae"):
        assert np.all(np.isfinite(h4[key]))
        np.testing.assert_allclose(h4[key], h1[key], rtol=1e-2, atol=1e-2)
    assert h4["loss"][-1] < h4["loss"][0]


def _fit_loss_scale(strategy, x, y, epochs, run_eagerly=False, hidden=True, **loss_scale):
    keras.utils.set_random_seed(1)
    with strategy.scope():
        layers = [keras.layers.Dense(4, "relu")] if hidden else []
        layers.append(keras.layers.Dense(1, kernel_initializer="ones"))
        model = keras.Sequential([keras.Input((x.shape[1],)), *layers])
        optimizer = keras.optimizers.LossScaleOptimizer(
            keras.optimizers.SGD(0.01, momentum=0.5), **loss_scale
        )
        model.compile(optimizer, "mse", run_eagerly=run_eagerly)
    history = model.fit(x, y, batch_size=8, epochs=epochs, verbose=0, shuffle=False)
    return model, history.history


def _assert_loss_scale_runs_equal(distributed, single, atol=1e-6):
    assert _iterations(distributed) == _iterations(single)
    for variable in distributed.optimizer.variables:
        assert isinstance(variable, kd.MirroredVariable), variable.path
    for name in ("dynamic_scale", "step_counter"):
        assert np.asarray(getattr(distributed.optimizer, name).value) == np.asarray(
            getattr(single.optimizer, name).value
        )
    _assert_same_weights(distributed, single, atol=atol)
    for a, b in zip(_optimizer_state(distributed), _optimizer_state(single)):
        np.testing.assert_allclose(a, b, rtol=0, atol=atol)


def test_loss_scale_optimizer_matches_one_device():
    # dynamic_growth_steps=3: the scale doubles twice in 8 steps.
    kwargs = dict(initial_scale=64.0, dynamic_growth_steps=3)
    single, h1 = _fit_loss_scale(kd.OneDeviceStrategy("/cpu:0"), X, Y, 2, **kwargs)
    distributed, h4 = _fit_loss_scale(kd.MirroredStrategy(cpus(4)), X, Y, 2, **kwargs)
    assert _iterations(single) == 8
    assert float(single.optimizer.dynamic_scale.value) == 256.0
    _assert_loss_scale_runs_equal(distributed, single)
    np.testing.assert_allclose(h4["loss"], h1["loss"], rtol=1e-5)


# Two rows of eight overflow: with 4 replicas only the last replica's gradients
# are infinite, and every replica must skip the step (TF tests the summed
# gradients). Before the fix in `_keras/_optimizer.py`'s loss-scale hook the
# replicas took different `ops.cond` branches and XLA aborted the process.
_OVERFLOW_X = np.array([[0.0]] * 6 + [[10.0]] * 2, "float32")
_OVERFLOW_Y = np.zeros((8, 1), "float32")


def test_loss_scale_optimizer_skips_a_step_that_overflows_on_one_replica():
    kwargs = dict(initial_scale=1e37, dynamic_growth_steps=2, hidden=False)
    single, h1 = _fit_loss_scale(
        kd.OneDeviceStrategy("/cpu:0"), _OVERFLOW_X, _OVERFLOW_Y, 3, **kwargs
    )
    # Step 1 overflowed (skipped, scale halved); steps 2 and 3 applied, and the
    # second finite step doubled the scale back.
    assert _iterations(single) == 2
    assert float(single.optimizer.dynamic_scale.value) == np.float32(1e37)
    distributed, h4 = _fit_loss_scale(
        kd.MirroredStrategy(cpus(4)), _OVERFLOW_X, _OVERFLOW_Y, 3, **kwargs
    )
    _assert_loss_scale_runs_equal(distributed, single)
    np.testing.assert_allclose(h4["loss"], h1["loss"], rtol=1e-5)


def test_loss_scale_optimizer_with_run_eagerly():
    # LossScaleOptimizer.stateless_apply in a replica sums the gradients in a
    # merge_call and decides once, in the cross-replica context (as TF).
    single, _ = _fit_loss_scale(kd.OneDeviceStrategy("/cpu:0"), X, Y, 1)
    reference, _ = _fit_loss_scale(kd.OneDeviceStrategy("/cpu:0"), X, Y, 1, run_eagerly=True)
    _assert_loss_scale_runs_equal(reference, single)
    mirrored, _ = _fit_loss_scale(kd.MirroredStrategy(cpus(4)), X, Y, 1, run_eagerly=True)
    _assert_loss_scale_runs_equal(mirrored, single, atol=1e-5)


# ---------------------------------------- gradient accumulation, moving average
@pytest.mark.parametrize(
    "optimizer_kwargs",
    [
        dict(gradient_accumulation_steps=2),
        dict(use_ema=True, ema_momentum=0.9, ema_overwrite_frequency=3),
    ],
    ids=["gradient_accumulation", "ema"],
)
def test_optimizer_options_match_one_device(optimizer_kwargs):
    runs = []
    mirrored = kd.MirroredStrategy(cpus(4))
    for strategy in (kd.OneDeviceStrategy("/cpu:0"), mirrored):
        model = _model(
            strategy, optimizer=lambda: keras.optimizers.SGD(0.05, momentum=0.5, **optimizer_kwargs)
        )
        # 7 steps: an odd count leaves a gradient half-accumulated.
        history = model.fit(X[:28], Y[:28], batch_size=4, epochs=1, verbose=0, shuffle=False)
        runs.append((model, history.history))
    (single, h1), (distributed, h4) = runs
    _assert_distributed(distributed, mirrored)
    assert _iterations(distributed) == _iterations(single)
    if "gradient_accumulation_steps" in optimizer_kwargs:
        assert _iterations(single) == 3  # 7 steps, one update per 2
        accumulators = [v for v in single.optimizer.variables if "accumulator" in v.path]
        assert accumulators and any(np.any(np.asarray(v.value) != 0) for v in accumulators)
    _assert_same_weights(distributed, single, atol=1e-6)
    for a, b in zip(_optimizer_state(distributed), _optimizer_state(single)):
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-6)
    np.testing.assert_allclose(h4["loss"], h1["loss"], rtol=1e-5)


def test_an_optimizer_built_outside_the_scope_makes_its_slots_in_the_strategy():
    # Created in the scope, built after it (`optimizer.build(model.trainable_variables)`):
    # TF makes the slots beside their variables; they were plain variables here, and fit
    # refused the optimizer as "created outside the scope".
    x = np.linspace(-1, 1, 32, dtype="float32").reshape(8, 4)
    y = x.sum(axis=1, keepdims=True)

    def train(strategy):
        keras.utils.set_random_seed(5)
        with strategy.scope() if strategy else contextlib.nullcontext():
            model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
            model.compile(optimizer=keras.optimizers.SGD(0.1, momentum=0.9), loss="mse")
        model.optimizer.build(model.trainable_variables)
        model.fit(x, y, batch_size=8, epochs=3, verbose=0, shuffle=False)
        return model.optimizer.variables

    want = [np.asarray(v.numpy()) for v in train(None)]
    got = train(kd.MirroredStrategy(cpus(4)))
    assert [type(v).__name__ for v in got] == ["MirroredVariable"] * 4
    for g, w in zip(got, want):
        np.testing.assert_allclose(np.asarray(g.numpy()), w, rtol=1e-5, atol=1e-7)
