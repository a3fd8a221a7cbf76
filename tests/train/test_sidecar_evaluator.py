"""``kd.train.SidecarEvaluator``: tf.keras's evaluator task, beside a training job."""

import threading
import time

import keras
import numpy as np
import pytest
from conftest import cpus

import keras_dist as kd

ROWS = 24


def _data():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(ROWS, 3)).astype("float32")
    return x, x.sum(axis=1, keepdims=True)


def _model():
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(4), keras.layers.Dense(1)])
    model.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse", metrics=["mae"])
    return model


def _snapshots(epochs):
    """The trained weights after each epoch, its optimizer's iterations and its metrics."""
    keras.utils.set_random_seed(1)
    model, (x, y) = _model(), _data()
    snapshots = []
    for _ in range(epochs):
        model.fit(x, y, batch_size=8, epochs=1, verbose=0, shuffle=False)
        logs = model.evaluate(x, y, batch_size=8, verbose=0, return_dict=True)
        snapshots.append((model.get_weights(), int(model.optimizer.iterations.numpy()), logs))
    return model, snapshots


def test_each_new_checkpoint_is_evaluated_as_the_trained_model(tmp_path):
    trained, snapshots = _snapshots(3)
    checkpoint = kd.train.Checkpoint(model=trained, optimizer=trained.optimizer)
    manager = kd.train.CheckpointManager(checkpoint, str(tmp_path), max_to_keep=2)
    # The evaluator task runs its own strategy (2 replicas: the batches of 8 split).
    strategy = kd.MirroredStrategy(cpus(2))
    with strategy.scope():
        evaluated = _model()
    evaluator = kd.train.SidecarEvaluator(
        evaluated, _data(), str(tmp_path), max_evaluations=3, timeout=30, verbose=0
    )

    def train():  # the training job: a checkpoint once the previous one was evaluated
        for i, (weights, _, _) in enumerate(snapshots):
            trained.set_weights(weights)
            trained.optimizer.iterations.assign(snapshots[i][1])
            manager.save()
            end = time.monotonic() + 30
            while len(evaluator.results) <= i and time.monotonic() < end:
                time.sleep(0.05)

    writer = threading.Thread(target=train)
    writer.start()
    evaluator.start()  # returns after ckpt-3 (max_evaluations, TF's rule)
    writer.join()
    assert [iterations for iterations, _ in evaluator.results] == [3, 6, 9]
    for (_, got), (_, _, want) in zip(evaluator.results, snapshots):
        assert got.keys() == want.keys()
        for name in want:
            np.testing.assert_allclose(got[name], want[name], rtol=1e-5)


def test_model_checkpoint_weight_files_are_evaluated_with_their_iterations(tmp_path):
    x, y = _data()
    keras.utils.set_random_seed(1)
    trained = _model()
    trained.fit(
        x,
        y,
        batch_size=8,
        epochs=2,
        verbose=0,
        shuffle=False,
        callbacks=[
            kd.callbacks.ModelCheckpoint(
                str(tmp_path / "ckpt-{epoch}.weights.h5"), save_weights_only=True
            )
        ],
    )
    want = trained.evaluate(x, y, batch_size=8, verbose=0, return_dict=True)
    evaluator = kd.train.SidecarEvaluator(
        _model(), (x, y), str(tmp_path), max_evaluations=2, timeout=5, verbose=0
    )
    evaluator.start()  # the newest file, ckpt-2: the last
    [(iterations, got)] = evaluator.results
    assert iterations == 6
    np.testing.assert_allclose(got["loss"], want["loss"], rtol=1e-5)


def test_without_new_checkpoints_it_stops_after_its_timeout(tmp_path):
    start = time.monotonic()
    evaluator = kd.train.SidecarEvaluator(_model(), _data(), str(tmp_path), timeout=0.5)
    evaluator.start()
    assert evaluator.results == []
    assert time.monotonic() - start < 5
    assert list(kd.train.checkpoints_iterator(str(tmp_path), timeout=0.2)) == []


def test_bad_arguments_say_what_was_received(tmp_path):
    with pytest.raises(ValueError, match="compiled model.*Received"):
        kd.train.SidecarEvaluator(keras.Sequential([keras.layers.Dense(1)]), _data(), tmp_path)
    with pytest.raises(ValueError, match="max_evaluations=0"):
        kd.train.SidecarEvaluator(_model(), _data(), tmp_path, max_evaluations=0)
