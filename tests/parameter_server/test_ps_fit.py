"""``model.fit``/``evaluate``/``predict`` under ParameterServerStrategy (coordinator mode).

One worker runs the steps one after another, so its weights must equal a
plain Keras fit's; two workers run them asynchronously, and every step still
counts: ``optimizer.iterations == epochs × steps_per_epoch`` exactly.
"""

import keras
import numpy as np
import pytest

import keras_dist as kd

pytestmark = pytest.mark.timeout(180)


def _data(rows=256):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(rows, 8)).astype("float32")
    y = (x @ rng.normal(size=(8, 1))).astype("float32")
    return x, y


def _model(optimizer):
    keras.utils.set_random_seed(1337)
    model = keras.Sequential(
        [keras.Input((8,)), keras.layers.Dense(16, activation="relu"), keras.layers.Dense(1)]
    )
    model.compile(optimizer, "mse", metrics=["mae"])
    return model


def _one_worker_fit_against_plain_keras(**compile_options):
    """``(model, plain)`` after 2 epochs of ``fit`` on one worker and 2 ps, and in plain
    Keras; their losses and weights are checked to be the same."""
    x, y = _data()
    plain = _model(keras.optimizers.SGD(0.05, momentum=0.9))
    expected = plain.fit(x, y, batch_size=32, epochs=2, shuffle=False, verbose=0)
    strategy = kd.ParameterServerStrategy(
        kd.testing.create_in_process_cluster(num_workers=1, num_ps=2)
    )
    with strategy.scope():
        model = _model(keras.optimizers.SGD(0.05, momentum=0.9))
        if compile_options:
            model.compile(model.optimizer, "mse", metrics=["mae"], **compile_options)
    history = model.fit(x, y, batch_size=32, epochs=2, shuffle=False, verbose=0)
    for name in ("loss", "mae"):
        np.testing.assert_allclose(history.history[name], expected.history[name], rtol=1e-5)
    for mine, theirs in zip(model.get_weights(), plain.get_weights()):
        np.testing.assert_allclose(mine, theirs, rtol=1e-5, atol=1e-6)
    return model, plain


def test_one_worker_fit_equals_plain_keras():
    x, y = _data()
    model, plain = _one_worker_fit_against_plain_keras()
    assert {v.device for v in model.trainable_variables} == {
        "/job:ps/replica:0/task:0/device:CPU:0",
        "/job:ps/replica:0/task:1/device:CPU:0",
    }
    np.testing.assert_allclose(
        model.evaluate(x, y, verbose=0), plain.evaluate(x, y, verbose=0), rtol=1e-5
    )
    np.testing.assert_allclose(
        model.predict(x[:50], batch_size=16, verbose=0),
        plain.predict(x[:50], batch_size=16, verbose=0),
        rtol=1e-5,
        atol=1e-6,
    )


def test_two_workers_two_ps_count_every_step():
    x, y = _data()
    strategy = kd.ParameterServerStrategy(
        kd.testing.create_in_process_cluster(num_workers=2, num_ps=2)
    )
    with strategy.scope():
        model = _model(keras.optimizers.Adam(0.01))
    history = model.fit(x, y, batch_size=32, epochs=3, verbose=0, validation_data=(x, y))
    assert int(model.optimizer.iterations.numpy()) == 3 * 8
    losses = history.history["loss"]
    assert losses[-1] < losses[0] * 0.6
    assert history.history["val_loss"][-1] < history.history["val_loss"][0]


def test_steps_per_epoch_with_an_infinite_generator():
    x, y = _data(64)

    def forever():
        while True:
            for i in range(0, 64, 16):
                yield x[i : i + 16], y[i : i + 16]

    strategy = kd.ParameterServerStrategy(
        kd.testing.create_in_process_cluster(num_workers=2, num_ps=1)
    )
    with strategy.scope():
        model = _model(keras.optimizers.SGD(0.01))
    model.fit(forever(), steps_per_epoch=5, epochs=2, verbose=0)
    assert int(model.optimizer.iterations.numpy()) == 10


class _InterruptAfterEpoch(keras.callbacks.Callback):
    def __init__(self, epoch):
        super().__init__()
        self.epoch = epoch

    def on_epoch_end(self, epoch, logs=None):
        if epoch == self.epoch:
            raise RuntimeError("interrupted")


def test_backup_and_restore_resumes_ps_held_state_and_saves_a_plain_model(tmp_path):
    x, y = _data(128)
    strategy = kd.ParameterServerStrategy(
        kd.testing.create_in_process_cluster(num_workers=2, num_ps=2)
    )
    backup = str(tmp_path / "backup")
    with strategy.scope():
        model = _model(keras.optimizers.SGD(0.05))
    with pytest.raises(RuntimeError, match="interrupted"):
        model.fit(
            x,
            y,
            batch_size=32,
            epochs=4,
            verbose=0,
            callbacks=[kd.callbacks.BackupAndRestore(backup), _InterruptAfterEpoch(1)],
        )
    assert int(model.optimizer.iterations.numpy()) == 2 * 4
    with strategy.scope():
        restarted = _model(keras.optimizers.SGD(0.05))
    history = restarted.fit(
        x, y, batch_size=32, epochs=4, verbose=0, callbacks=[kd.callbacks.BackupAndRestore(backup)]
    )
    assert history.epoch == [2, 3]
    assert int(restarted.optimizer.iterations.numpy()) == 4 * 4

    checkpoint = str(tmp_path / "model.keras")
    restarted.fit(
        x,
        y,
        batch_size=32,
        epochs=1,
        verbose=0,
        callbacks=[keras.callbacks.ModelCheckpoint(checkpoint)],
    )
    plain = keras.models.load_model(checkpoint)
    assert not any(isinstance(v, kd.MirroredVariable) for v in plain.weights)
    assert type(plain.weights[0]) is type(keras.Variable(0.0))
    np.testing.assert_allclose(
        plain.predict(x, verbose=0), restarted.predict(x, verbose=0), rtol=1e-6, atol=1e-6
    )


def _endless_batches(built_for):
    """A ``dataset_fn`` of a worker's own endless batches; it notes whom it was built for."""
    w = np.random.default_rng(0).normal(size=(8, 1)).astype("float32")

    def dataset_fn(context):
        built_for.append(context.input_pipeline_id)
        rng = np.random.default_rng(context.input_pipeline_id)
        while True:
            x = rng.normal(size=(16, 8)).astype("float32")
            yield x, x @ w

    return dataset_fn


def _two_worker_model(**compile_options):
    strategy = kd.ParameterServerStrategy(
        kd.testing.create_in_process_cluster(num_workers=2, num_ps=1)
    )
    with strategy.scope():
        model = _model(keras.optimizers.SGD(0.05))
        if compile_options:
            model.compile(model.optimizer, "mse", metrics=["mae"], **compile_options)
    return model


def test_dataset_creator_is_read_on_the_workers():
    # Spec 89: 10 epochs × 10 steps → optimizer.iterations == 100.
    built_for = []
    dataset_fn = _endless_batches(built_for)
    model = _two_worker_model()
    creator = kd.experimental.DatasetCreator(dataset_fn)
    history = model.fit(
        creator,
        epochs=10,
        steps_per_epoch=10,
        validation_data=kd.experimental.DatasetCreator(dataset_fn),
        validation_steps=2,
        verbose=0,
    )
    assert int(model.optimizer.iterations.numpy()) == 100
    assert history.history["loss"][-1] < 0.1 * history.history["loss"][0]
    assert len(history.history["val_loss"]) == 10
    # The coordinator only looked at the structure (the workers got copies of dataset_fn).
    assert set(built_for) == {0}
    # Predictions of batches read on the workers could not be matched to their inputs.
    with pytest.raises(ValueError, match="not a `DatasetCreator`"):
        model.predict(creator, steps=2, verbose=0)


class _CountSchedules:
    """Counts the functions ``fit`` schedules on the workers."""

    def __init__(self, monkeypatch):
        self.count = 0
        original = kd.coordinator.ClusterCoordinator.schedule

        def schedule(coordinator, fn, args=None, kwargs=None):
            self.count += 1
            return original(coordinator, fn, args=args, kwargs=kwargs)

        monkeypatch.setattr(kd.coordinator.ClusterCoordinator, "schedule", schedule)


def test_steps_per_execution_runs_that_many_steps_in_one_scheduled_function(monkeypatch):
    # 256 rows in batches of 32: 8 steps an epoch, executions of 3, 3 and 2 steps.
    scheduled = _CountSchedules(monkeypatch)
    model, plain = _one_worker_fit_against_plain_keras(steps_per_execution=3)
    assert scheduled.count == 2 * 3
    assert int(model.optimizer.iterations.numpy()) == 2 * 8
    x, y = _data()
    scheduled.count = 0
    evaluation = model.evaluate(x, y, batch_size=64, verbose=0)  # 4 batches: 3 and 1
    assert scheduled.count == 2
    expected_evaluation = plain.evaluate(x, y, batch_size=64, verbose=0)
    np.testing.assert_allclose(evaluation, expected_evaluation, rtol=1e-5)
    scheduled.count = 0
    predictions = model.predict(x[:100], batch_size=16, verbose=0)  # 7 batches: 3, 3 and 1
    assert scheduled.count == 3
    expected_predictions = plain.predict(x[:100], batch_size=16, verbose=0)
    np.testing.assert_allclose(predictions, expected_predictions, rtol=1e-5, atol=1e-6)


def test_steps_per_execution_on_two_workers_counts_every_step_from_a_dataset_creator(
    monkeypatch,
):
    model = _two_worker_model(steps_per_execution=4)
    scheduled = _CountSchedules(monkeypatch)
    creator = kd.experimental.DatasetCreator(_endless_batches([]))
    history = model.fit(creator, epochs=5, steps_per_epoch=12, verbose=0)
    assert scheduled.count == 5 * 3  # each worker reads 4 batches of its own a function
    assert int(model.optimizer.iterations.numpy()) == 5 * 12
    assert history.history["loss"][-1] < 0.1 * history.history["loss"][0]


def test_an_optimizer_created_outside_the_scope_is_refused_not_left_uncounted():
    # Keras makes the step counter with the optimizer: made outside the scope it lived on
    # the coordinator only, and fit (or a scheduled custom step) trained with Adam's bias
    # correction stuck at step 0, silently. TF refuses it; so does keras_dist, by name.
    x, y = _data(64)
    strategy = kd.ParameterServerStrategy(
        kd.testing.create_in_process_cluster(num_workers=1, num_ps=1)
    )
    with strategy.scope():
        model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(1)])
    optimizer = keras.optimizers.Adam(0.1)
    model.compile(optimizer, "mse")
    with pytest.raises(ValueError, match=r"optimizer was created outside .*adam(_\d+)?/iteration"):
        model.fit(x, y, batch_size=32, epochs=1, verbose=0)

    optimizer.build(model.trainable_variables)
    coordinator = kd.coordinator.ClusterCoordinator(strategy)

    def step():
        def replica_fn():
            loss_fn = lambda: keras.ops.mean((model(x) - y) ** 2)  # noqa: E731
            _, grads = kd.value_and_grad(loss_fn, model.trainable_variables)()
            optimizer.apply_gradients(zip(grads, model.trainable_variables))

        strategy.run(replica_fn)

    with pytest.raises(ValueError, match="created outside `strategy.scope\\(\\)` and is written"):
        coordinator.schedule(step)
        coordinator.join()


def test_an_optimizer_created_outside_a_mirrored_scope_is_refused_by_name():
    x, y = _data(64)
    strategy = kd.MirroredStrategy(["/cpu:0"])
    with strategy.scope():
        model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(1)])
    model.compile(keras.optimizers.Adam(0.1), "mse")
    with pytest.raises(ValueError, match="optimizer was created outside"):
        model.fit(x, y, batch_size=32, epochs=1, verbose=0)


def test_train_and_test_on_batch_return_their_own_batch_logs():
    # fit's batch-level logs may be a step behind (the steps run ahead); a single batch's
    # call returns its own, as plain Keras's does.
    def build():
        model = keras.Sequential(
            [keras.Input((4,)), keras.layers.Dense(3, use_bias=False, kernel_initializer="ones")]
        )
        model.compile(keras.optimizers.SGD(0.01), "mse")
        return model

    x, y = np.ones((16, 4), "float32"), np.zeros((16, 3), "float32")
    plain = build()
    expected = [plain.train_on_batch(x, y) for _ in range(3)] + [plain.test_on_batch(x, y)]
    strategy = kd.ParameterServerStrategy(
        kd.testing.create_in_process_cluster(num_workers=1, num_ps=1)
    )
    with strategy.scope():
        model = build()
    actual = [model.train_on_batch(x, y) for _ in range(3)] + [model.test_on_batch(x, y)]
    np.testing.assert_allclose(actual, expected, rtol=1e-6)
    assert expected[0] != expected[1]  # (each batch's own loss)


def test_a_recompiled_model_logs_its_new_metrics():
    # Keras's test_recompile: every loop's logs are its own (an evaluate's logs, or those
    # of the model before it was compiled again, never stand for a later loop's).
    x, y = np.ones((3, 2), "float32"), np.ones((3, 3), "float32")
    strategy = kd.ParameterServerStrategy(
        kd.testing.create_in_process_cluster(num_workers=1, num_ps=1)
    )
    keys = []
    with strategy.scope():
        model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(3)])
        for metric in ("mean_squared_error", "mean_absolute_error"):
            model.compile("sgd", "mse", metrics=[metric])
            keys.append(sorted(model.fit(x, y, verbose=0).history))
            keys.append(sorted(model.evaluate(x, y, return_dict=True, verbose=0)))
    assert keys == [["loss", "mean_squared_error"]] * 2 + [["loss", "mean_absolute_error"]] * 2


class _BatchLosses(keras.callbacks.Callback):
    def __init__(self):
        super().__init__()
        self.losses = []

    def on_train_batch_end(self, batch, logs=None):
        self.losses.append(logs["loss"])


def test_a_callback_reading_batch_logs_gets_each_batch_own_loss_on_two_workers():
    # The steps otherwise run ahead of the callbacks (two workers, steps in flight): a
    # callback reading a batch's logs would get an earlier step's. TF refuses such
    # callbacks; here the steps then run one after another, each batch's loss its own.
    def build():
        model = keras.Sequential(
            [keras.Input((4,)), keras.layers.Dense(1, kernel_initializer="ones")]
        )
        model.compile(keras.optimizers.SGD(0.01), "mse")
        return model

    rows = np.random.default_rng(0).normal(size=(64, 4)).astype("float32")
    x, y = rows, rows.sum(axis=1, keepdims=True) * 0.5
    plain, plain_losses = build(), _BatchLosses()
    plain.fit(x, y, batch_size=8, epochs=2, shuffle=False, callbacks=[plain_losses], verbose=0)
    strategy = kd.ParameterServerStrategy(
        kd.testing.create_in_process_cluster(num_workers=2, num_ps=1)
    )
    with strategy.scope():
        model = build()
    losses = _BatchLosses()
    model.fit(x, y, batch_size=8, epochs=2, shuffle=False, callbacks=[losses], verbose=0)
    assert len(losses.losses) == 16
    assert len(set(np.round(plain_losses.losses, 5))) == 16  # (every batch's loss differs)
    np.testing.assert_allclose(losses.losses, plain_losses.losses, rtol=1e-5)
    np.testing.assert_allclose(model.get_weights()[0], plain.get_weights()[0], rtol=1e-5)


class _DropoutAtInference(keras.layers.Layer):
    def __init__(self):
        super().__init__()
        self.seed_generator = keras.random.SeedGenerator(3)

    def call(self, x):
        return keras.random.dropout(x, 0.5, seed=self.seed_generator)


def test_predict_and_evaluate_move_layer_state_on_as_keras_does():
    # A seed generator's state is a non-trainable variable that Keras's predict and
    # evaluate advance: each call draws a new dropout mask.
    def build():
        model = keras.Sequential([keras.Input((20,)), _DropoutAtInference()])
        model.compile("sgd", "mse")
        return model

    x = np.ones((32, 20), "float32")
    plain = build()
    expected = [plain.predict(x, verbose=0), plain.predict(x, verbose=0)]
    plain.evaluate(x, x, verbose=0)
    strategy = kd.ParameterServerStrategy(
        kd.testing.create_in_process_cluster(num_workers=1, num_ps=1)
    )
    with strategy.scope():
        model = build()
    actual = [model.predict(x, verbose=0), model.predict(x, verbose=0)]
    assert np.abs(actual[0] - actual[1]).mean() > 0.1
    np.testing.assert_array_equal(actual, expected)
    model.evaluate(x, x, verbose=0)
    seed_state = model.layers[0].seed_generator.state
    np.testing.assert_array_equal(
        np.asarray(seed_state.value), np.asarray(plain.layers[0].seed_generator.state.value)
    )
