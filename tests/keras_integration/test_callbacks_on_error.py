"""A ``fit``, ``evaluate`` or ``predict`` that raises leaves no writer, thread or file open.

Keras calls the callbacks' end hooks only when a loop returns; keras_dist's loop
hooks release what a callback holds when it raises (``HoldsResources``). Twenty
failing loops in a row must leave the process's threads and open files where
the first one left them, and every event file written so far whole.
"""

import contextlib
import os
import threading

import keras
import numpy as np
import pytest
from conftest import cpus
from tensorboard.backend.event_processing.plugin_event_accumulator import EventAccumulator

import keras_dist as kd
from keras_dist.callbacks import BackupAndRestore
from keras_dist.callbacks import TensorBoard

X = np.random.RandomState(0).rand(64, 3).astype("float32")
Y = X.sum(axis=1, keepdims=True)
FAILING_BATCH = 2
LOOPS = 20


class _RaiseAtBatch(keras.callbacks.Callback):
    """Raises at the end of batch ``FAILING_BATCH`` of whichever loop it is given to."""

    def _raise(self, batch):
        if batch == FAILING_BATCH:
            raise RuntimeError("failed mid-epoch")

    def on_train_batch_end(self, batch, logs=None):
        self._raise(batch)

    def on_test_batch_end(self, batch, logs=None):
        self._raise(batch)

    def on_predict_batch_end(self, batch, logs=None):
        self._raise(batch)


class _Raising(keras.layers.Layer):
    """A layer that raises on the host once ``FAILING_BATCH`` batches have run."""

    def __init__(self):
        super().__init__()
        self.calls = 0

    def call(self, x):
        self.calls += 1
        if self.calls > FAILING_BATCH:
            raise RuntimeError("failed mid-epoch")
        return x


def _model(kind, layers=()):
    scope = kd.MirroredStrategy(cpus(2)).scope() if kind == "mirrored" else None
    with scope or contextlib.nullcontext():
        model = keras.Sequential([keras.Input((3,)), *layers, keras.layers.Dense(1)])
        model.compile("sgd", "mse", run_eagerly=bool(layers))
    return model


def _open_files() -> int:
    return len(os.listdir("/proc/self/fd"))


def _usage() -> tuple:
    return threading.active_count(), _open_files()


def _run_failing(loop, model, callbacks):
    arguments = {"batch_size": 8, "callbacks": callbacks, "verbose": 0}
    with pytest.raises(RuntimeError, match="failed mid-epoch"):
        if loop == "fit":
            model.fit(X, Y, epochs=2, **arguments)
        elif loop == "evaluate":
            model.evaluate(X, Y, **arguments)
        else:
            model.predict(X, **arguments)


def _event_steps(run_dir, tag) -> list:
    accumulator = EventAccumulator(str(run_dir), size_guidance={"tensors": 0})
    accumulator.Reload()
    return [event.step for event in accumulator.Tensors(tag)]


@pytest.mark.parametrize("kind", ["plain", "mirrored"])
def test_twenty_failing_fits_leave_threads_and_files_flat(tmp_path, kind):
    model = _model(kind)
    usage = []
    for run in range(LOOPS):
        callbacks = [
            TensorBoard(str(tmp_path / f"run{run}"), update_freq=1),
            BackupAndRestore(str(tmp_path / f"backup{run}"), save_freq=1),
            _RaiseAtBatch(),
        ]
        _run_failing("fit", model, callbacks)
        usage.append(_usage())
    assert usage == [usage[0]] * LOOPS
    for run in range(LOOPS):
        # Closed, hence whole: the graph and every batch logged before the failure.
        train = tmp_path / f"run{run}" / "train"
        assert _event_steps(train, "keras") == [0]
        assert _event_steps(train, "batch_loss") == list(range(1, FAILING_BATCH + 2))
        # The backup of the last batch trained stays for the next fit.
        assert os.listdir(tmp_path / f"backup{run}") == ["chief"]


@pytest.mark.parametrize("loop", ["fit", "evaluate", "predict"])
def test_a_layer_raising_in_any_loop_closes_the_event_files(tmp_path, loop):
    usage = []
    for run in range(LOOPS):
        # A new model each time: Keras 3.15's JAX loops leave a model whose eager
        # step raised without its variables' values (purged, not put back).
        model = _model("plain", [_Raising()])
        _run_failing(loop, model, [TensorBoard(str(tmp_path / f"run{run}"), update_freq=1)])
        usage.append(_usage())
    assert usage == [usage[0]] * LOOPS
    for run in range(LOOPS):
        assert _event_steps(tmp_path / f"run{run}" / "train", "keras") == [0]


@pytest.mark.parametrize("loop", ["evaluate", "predict"])
def test_failing_evaluates_and_predicts_under_a_strategy_leave_nothing_open(tmp_path, loop):
    model = _model("mirrored")
    usage = []
    for run in range(LOOPS):
        callbacks = [TensorBoard(str(tmp_path / f"run{run}")), _RaiseAtBatch()]
        _run_failing(loop, model, callbacks)
        usage.append(_usage())
    assert usage == [usage[0]] * LOOPS
    for run in range(LOOPS):
        assert _event_steps(tmp_path / f"run{run}" / "train", "keras") == [0]


def test_a_successful_fit_writes_as_before_and_closes(tmp_path):
    model = _model("mirrored")
    model.fit(X, Y, batch_size=8, epochs=2, verbose=0)  # compiled before counting
    before = _usage()
    history = model.fit(
        X, Y, batch_size=8, epochs=2, verbose=0, callbacks=[TensorBoard(str(tmp_path))]
    )
    assert _usage() == before
    assert _event_steps(tmp_path / "train", "epoch_loss") == history.epoch
