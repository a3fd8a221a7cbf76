"""``keras_dist.callbacks``: chief-only ModelCheckpoint and TensorBoard, exact BackupAndRestore.

As TF's BackupAndRestore and multi-worker callback tests: a resumed ``fit`` must end
with the weights of an uninterrupted one, bit for bit: the model has Adam (slots,
iteration counter), Dropout (a seed generator's state) and a metric, and ``fit``
shuffles with NumPy's global random state. Non-chief behaviour is tested in one process
by giving the callbacks the role of worker 1 of 2.
"""

import contextlib
import functools
import json
import os
import signal
import subprocess
import sys

import keras
import numpy as np
import pytest
from conftest import cpus
from tensorboard.backend.event_processing.plugin_event_accumulator import EventAccumulator
from tensorboard.util import tensor_util

import keras_dist as kd
from keras_dist.callbacks import BackupAndRestore
from keras_dist.callbacks import ModelCheckpoint
from keras_dist.callbacks import TensorBoard
from keras_dist.callbacks import _preemption
from keras_dist.callbacks import _training_state
from keras_dist.callbacks import _writer_role
from keras_dist.callbacks._summaries import histogram_bucket_rows
from keras_dist.cluster_resolver import ClusterSpec
from keras_dist.cluster_resolver import SimpleClusterResolver

X = np.random.RandomState(0).rand(32, 3).astype("float32")
Y = X.sum(axis=1, keepdims=True)
EPOCHS = 4  # of 4 batches of 8
SHUFFLE_SEED = 7  # NumPy's global seed before the first fit of a run
TWO_WORKERS = ClusterSpec({"worker": ["w0:2222", "w1:2222"]})


def _scope(kind):
    """The scope a ``kind`` model is built in: MirroredStrategy on 2 CPUs, or none (plain)."""
    if kind == "mirrored":
        return kd.MirroredStrategy(cpus(2)).scope()
    return contextlib.nullcontext()


def _model(kind, seed=1):
    with _scope(kind):
        keras.utils.set_random_seed(seed)
        model = keras.Sequential(
            [
                keras.Input((3,)),
                keras.layers.Dense(8, activation="relu"),
                keras.layers.Dropout(0.25),
                keras.layers.Dense(1),
            ]
        )
        model.compile(keras.optimizers.Adam(0.01), "mse", metrics=["mae"])
    return model


def _fit(model, callbacks=(), epochs=EPOCHS, **kwargs):
    return model.fit(
        X, Y, batch_size=8, epochs=epochs, callbacks=list(callbacks), verbose=0, **kwargs
    )


@functools.cache
def _reference(kind, steps_per_execution=1):
    """Weights, optimizer state and History of an uninterrupted run."""
    model = _model(kind)
    model.steps_per_execution = steps_per_execution
    np.random.seed(SHUFFLE_SEED)
    history = _fit(model)
    return model.get_weights(), _optimizer_state(model), history.history


def _optimizer_state(model):
    return [np.asarray(v) for v in model.optimizer.variables]


def _assert_same_history(actual, expected, kind):
    assert actual.keys() == expected.keys()
    for name in expected:
        rtol = 1e-6 if kind == "mirrored" else 0
        np.testing.assert_allclose(actual[name], expected[name], rtol=rtol, atol=0)


def _assert_equal_arrays(actual, expected):
    assert len(actual) == len(expected)
    for a, e in zip(actual, expected):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(e))


class _InterruptAtEpochEnd(keras.callbacks.Callback):
    def __init__(self, epoch):
        super().__init__()
        self.epoch = epoch

    def on_epoch_end(self, epoch, logs=None):
        if epoch == self.epoch:
            raise RuntimeError("interrupted")


class _InterruptAtBatch(keras.callbacks.Callback):
    """Raises at the end of the ``count``-th training call of the fit."""

    def __init__(self, count):
        super().__init__()
        self.count = count
        self.seen = 0

    def on_train_batch_end(self, batch, logs=None):
        self.seen += 1
        if self.seen == self.count:
            raise RuntimeError("interrupted")


def _interrupted_fit(model, backup, interrupt, **kwargs):
    np.random.seed(SHUFFLE_SEED)
    with pytest.raises(RuntimeError, match="interrupted"):
        _fit(model, [backup, interrupt], **kwargs)


def _metadata(backup_dir):
    with open(os.path.join(backup_dir, "chief", _training_state.METADATA)) as f:
        return json.load(f)


def _as_worker(monkeypatch, task_id):
    role = _writer_role.ProcessRole("worker", task_id, TWO_WORKERS)
    monkeypatch.setattr(_writer_role, "process_role", lambda model: role)


# --------------------------------------------------------------------------
# The role of a process.


def test_role_comes_from_the_strategys_cluster_resolver(tmp_path):
    class FakeStrategy:
        def __init__(self, resolver):
            self.cluster_resolver = resolver

    worker1 = _writer_role.role_of_strategy(
        FakeStrategy(SimpleClusterResolver(TWO_WORKERS, task_type="worker", task_id=1))
    )
    assert not worker1.is_chief
    path = str(tmp_path / "model.keras")
    assert worker1.write_filepath(path) == str(tmp_path / "workertemp_1" / "model.keras")
    worker1.remove_temp_dir_with_filepath(worker1.write_filepath(path))
    assert not (tmp_path / "workertemp_1").exists()

    worker0 = SimpleClusterResolver(TWO_WORKERS, task_type="worker", task_id=0)
    assert _writer_role.role_of_strategy(FakeStrategy(worker0)).is_chief
    with_chief = ClusterSpec({"chief": ["c:1"], "worker": ["w0:1"]})
    worker0 = SimpleClusterResolver(with_chief, task_type="worker", task_id=0)
    assert not _writer_role.role_of_strategy(FakeStrategy(worker0)).is_chief
    chief = SimpleClusterResolver(with_chief, task_type="chief", task_id=0)
    assert _writer_role.role_of_strategy(FakeStrategy(chief)).is_chief

    single = _writer_role.process_role(_model("plain"))
    assert single == _writer_role.ProcessRole() and single.is_chief
    assert single.write_filepath(path) == path


# --------------------------------------------------------------------------
# Spec 66: ModelCheckpoint writes at the user's path on the chief only.


@pytest.mark.parametrize("name,weights_only", [("model.keras", False), ("w.weights.h5", True)])
@pytest.mark.parametrize("task_id", [0, 1])
def test_model_checkpoint_file_exists_iff_chief(tmp_path, monkeypatch, name, weights_only, task_id):
    _as_worker(monkeypatch, task_id)
    saved = []
    remove = _writer_role.ProcessRole.remove_temp_dir_with_filepath

    def remove_and_record(role, filepath):
        saved.append((filepath, os.path.exists(filepath)))
        remove(role, filepath)

    monkeypatch.setattr(
        _writer_role.ProcessRole, "remove_temp_dir_with_filepath", remove_and_record
    )
    path = str(tmp_path / name)
    checkpoint = ModelCheckpoint(path, save_weights_only=weights_only)
    _fit(_model("plain"), [checkpoint], epochs=2)

    assert os.path.exists(path) == (task_id == 0)
    assert sorted(os.listdir(tmp_path)) == ([name] if task_id == 0 else [])
    # Every worker saved (at epoch ends), the non-chief into its temp dir.
    expected = path if task_id == 0 else str(tmp_path / "workertemp_1" / name)
    assert saved == [(expected, True), (expected, True)]


# --------------------------------------------------------------------------
# Spec 67: BackupAndRestore.


@pytest.mark.parametrize("kind", ["plain", "mirrored"])
def test_resume_after_an_epoch_interruption_is_exact(tmp_path, kind):
    weights, optimizer_state, history = _reference(kind)
    backup_dir = str(tmp_path)
    backup = BackupAndRestore(backup_dir)
    _interrupted_fit(_model(kind), backup, _InterruptAtEpochEnd(2))
    assert _metadata(backup_dir)["epoch"] == 3
    assert os.path.exists(os.path.join(backup_dir, "chief", "latest.weights.h5"))

    resumed = _model(kind, seed=2)  # other initial weights, other shuffle state
    np.random.seed(123)
    resumed_history = _fit(resumed, [backup])
    assert resumed_history.epoch == [3]
    _assert_equal_arrays(resumed.get_weights(), weights)
    _assert_equal_arrays(_optimizer_state(resumed), optimizer_state)
    assert resumed_history.history == {k: v[3:] for k, v in history.items()}
    assert not os.path.exists(backup_dir)  # deleted once training succeeded


@pytest.mark.parametrize(
    "kind,steps_per_execution,save_freq,interrupt_at,resume_at",
    [
        # Backups after global batches 3, 6, 9; interrupted after 11: the
        # last backup is epoch 2 after 1 batch, and batches 10-11 are lost.
        ("plain", 1, 3, 11, (2, 1)),
        ("mirrored", 1, 9, 11, (2, 1)),  # few backups: each costs a retrace
        # Calls of 2 batches; a backup once 5 batches have run (after the
        # 3rd call: epoch 1 after 2 batches); interrupted after the 5th call.
        ("plain", 2, 5, 5, (1, 2)),
    ],
)
def test_resume_mid_epoch_is_exact(
    tmp_path, kind, steps_per_execution, save_freq, interrupt_at, resume_at
):
    weights, optimizer_state, history = _reference(kind, steps_per_execution)
    backup_dir = str(tmp_path)
    model = _model(kind)
    model.steps_per_execution = steps_per_execution
    backup = BackupAndRestore(backup_dir, save_freq=save_freq)
    _interrupted_fit(model, backup, _InterruptAtBatch(interrupt_at))
    metadata = _metadata(backup_dir)
    assert (metadata["epoch"], metadata["batch"]) == resume_at

    epoch = resume_at[0]
    resumed = _model(kind, seed=2)
    resumed.steps_per_execution = steps_per_execution
    np.random.seed(123)
    resumed_history = _fit(resumed, [BackupAndRestore(backup_dir, save_freq=save_freq)])
    assert resumed_history.epoch == list(range(epoch, EPOCHS))
    _assert_equal_arrays(resumed.get_weights(), weights)
    _assert_equal_arrays(_optimizer_state(resumed), optimizer_state)
    # The metrics were restored too: the resumed epoch reports the full epoch.
    # (Under a strategy a sum metric is restored split evenly between the
    # replicas, as tf.distribute restores SyncOnRead variables: the last bit
    # of the sum may differ.)
    expected_history = {k: v[epoch:] for k, v in history.items()}
    _assert_same_history(resumed_history.history, expected_history, kind)
    assert resumed.train_function is not None
    assert not os.path.exists(backup_dir)


class _RecordBatches(keras.callbacks.Callback):
    def __init__(self):
        super().__init__()
        self.batches = []

    def on_train_batch_begin(self, batch, logs=None):
        self.batches.append(batch)


def test_resumed_epoch_keeps_batch_numbers_and_backup_schedule(tmp_path, monkeypatch):
    backup_dir = str(tmp_path)
    _interrupted_fit(
        _model("plain"), BackupAndRestore(backup_dir, save_freq=3), _InterruptAtBatch(8)
    )
    assert (_metadata(backup_dir)["epoch"], _metadata(backup_dir)["batch"]) == (1, 2)

    saves = []
    monkeypatch.setattr(
        _training_state, "save", lambda model, d, **kw: saves.append(kw["epoch"] * 4 + kw["batch"])
    )
    record = _RecordBatches()
    _fit(_model("plain"), [BackupAndRestore(backup_dir, save_freq=3), record], epochs=3)
    assert record.batches == [0, 1, 2, 3] * 2  # the skipped batches 0 and 1 are seen too
    assert saves == [9, 12]  # every 3 batches, as in the uninterrupted run


def test_train_counter_after_interruptions_at_epochs_5_and_12(tmp_path):
    # tf_keras callbacks_test.test_backup_restore_train_counter: one step per
    # epoch; tf.keras's _train_counter is Keras 3's optimizer.iterations.
    model = keras.Sequential([keras.Input((1,)), keras.layers.Dense(1)])
    model.compile("sgd", "mse")
    backup = BackupAndRestore(str(tmp_path))

    class Interrupt(keras.callbacks.Callback):
        def on_epoch_end(self, epoch, logs=None):
            if epoch in (5, 12):
                raise RuntimeError("interrupted")

    x = y = np.ones((10, 1))
    for expected in (6, 13):
        with pytest.raises(RuntimeError):
            model.fit(x, y, epochs=20, callbacks=[backup, Interrupt()], verbose=0)
        assert int(model.optimizer.iterations) == expected
        assert os.path.isdir(tmp_path / "chief")
    history = model.fit(x, y, epochs=20, callbacks=[backup], verbose=0)
    assert history.epoch == list(range(13, 20))
    assert int(model.optimizer.iterations) == 20
    assert not os.path.exists(tmp_path)  # as Keras's: the backup directory is gone too
    assert model._initial_epoch is None  # a later fit starts from its own initial_epoch


def test_delete_checkpoint_false_keeps_the_backup(tmp_path):
    model = _model("plain")
    _fit(model, [BackupAndRestore(str(tmp_path), delete_checkpoint=False)], epochs=2)
    assert sorted(os.listdir(tmp_path / "chief")) == [
        "latest.weights.h5",
        "training_metadata.json",
        "training_state.npz",
    ]
    assert _metadata(str(tmp_path))["epoch"] == 2
    again = _fit(model, [BackupAndRestore(str(tmp_path), delete_checkpoint=False)], epochs=2)
    assert again.epoch == []  # the backup says both epochs are done


def test_double_checkpoint_falls_back_to_the_previous_backup(tmp_path):
    backup = BackupAndRestore(str(tmp_path), delete_checkpoint=False, double_checkpoint=True)
    _fit(_model("plain"), [backup], epochs=2)
    (tmp_path / "chief" / "latest.weights.h5").write_bytes(b"not an h5 file")
    assert _fit(_model("plain"), [backup], epochs=3).epoch == [1, 2]


def test_non_chief_restores_from_the_chiefs_backup_and_keeps_it(tmp_path, monkeypatch):
    backup_dir = str(tmp_path)
    _interrupted_fit(_model("plain"), BackupAndRestore(backup_dir), _InterruptAtEpochEnd(2))
    chief_files = {p.name: p.read_bytes() for p in (tmp_path / "chief").iterdir()}

    _as_worker(monkeypatch, 1)
    written = []
    save = _training_state.save

    def save_and_record(model, dirpath, **kwargs):
        save(model, dirpath, **kwargs)
        written.append(sorted(os.listdir(dirpath)))

    monkeypatch.setattr(_training_state, "save", save_and_record)
    weights, _, _ = _reference("plain")
    resumed = _model("plain", seed=2)
    assert _fit(resumed, [BackupAndRestore(backup_dir)]).epoch == [3]
    _assert_equal_arrays(resumed.get_weights(), weights)
    assert written == [sorted(chief_files)]  # it saved in full, in its temp dir...
    assert os.listdir(tmp_path) == ["chief"]  # ...which is gone; only the chief deletes
    assert {p.name: p.read_bytes() for p in (tmp_path / "chief").iterdir()} == chief_files


def test_backup_arguments():
    with pytest.raises(ValueError, match="save_before_preemption=True"):
        BackupAndRestore("/tmp/unused", save_freq=False)
    with pytest.raises(ValueError, match="save_freq"):
        BackupAndRestore("/tmp/unused", save_freq="batch")
    assert isinstance(BackupAndRestore("/tmp/unused"), keras.callbacks.BackupAndRestore)
    assert BackupAndRestore.PREEMPTION_EXIT_CODE == 42


# --------------------------------------------------------------------------
# Preemption.


class _Sigterm(keras.callbacks.Callback):
    """Sends this process SIGTERM at the end of the ``count``-th batch; records the handler."""

    def __init__(self, count):
        super().__init__()
        self.count = count
        self.seen = 0
        self.handlers = []

    def on_train_batch_end(self, batch, logs=None):
        self.handlers.append(signal.getsignal(signal.SIGTERM))
        self.seen += 1
        if self.seen == self.count:
            signal.raise_signal(signal.SIGTERM)


@contextlib.contextmanager
def _sigterm_handler(handler):
    previous = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def test_sigterm_saves_at_the_next_batch_end_and_exits_42(tmp_path):
    weights, _, history = _reference("plain")
    backup_dir = str(tmp_path)
    previous = signal.Handlers.SIG_IGN
    with _sigterm_handler(previous):
        backup = BackupAndRestore(backup_dir, save_before_preemption=True)
        sigterm = _Sigterm(6)  # after backup: it acts at the next batch end
        model = _model("plain")
        np.random.seed(SHUFFLE_SEED)
        with pytest.raises(SystemExit) as exit_info:
            _fit(model, [backup, sigterm])
        assert exit_info.value.code == 42
        assert signal.getsignal(signal.SIGTERM) == previous
        # The watcher's own handler during fit; released (and None) once fit exited.
        assert isinstance(sigterm.handlers[0].__self__, _preemption.PreemptionWatcher)
        assert all(h == sigterm.handlers[0] for h in sigterm.handlers)
        assert backup._watcher is None
    metadata = _metadata(backup_dir)
    assert (metadata["epoch"], metadata["batch"]) == (1, 3)  # after global batch 7

    resumed = _model("plain", seed=2)
    resumed_history = _fit(resumed, [BackupAndRestore(backup_dir)])
    _assert_equal_arrays(resumed.get_weights(), weights)
    assert resumed_history.history == {k: v[1:] for k, v in history.items()}


def test_sigterm_handler_is_installed_only_during_fit(tmp_path):
    def previous(signum, frame):
        raise AssertionError("not called")

    with _sigterm_handler(previous):
        record = _Sigterm(count=0)
        _fit(
            _model("plain"), [BackupAndRestore(str(tmp_path), save_before_preemption=True), record]
        )
        assert len(set(record.handlers)) == 1 and record.handlers[0] is not previous
        assert signal.getsignal(signal.SIGTERM) is previous


def test_a_sigterm_after_the_last_batch_goes_to_the_previous_handler(tmp_path):
    received = []

    class SigtermAtTheEnd(keras.callbacks.Callback):
        def on_epoch_end(self, epoch, logs=None):
            if epoch == 1:
                signal.raise_signal(signal.SIGTERM)

    with _sigterm_handler(lambda signum, frame: received.append(signum)):
        backup = BackupAndRestore(str(tmp_path), save_before_preemption=True)
        history = _fit(_model("plain"), [backup, SigtermAtTheEnd()], epochs=2)
    assert history.epoch == [0, 1]  # training completed, and the backup is deleted
    assert not os.path.exists(tmp_path)
    assert received == [signal.SIGTERM]


def test_several_processes_stop_at_jaxs_sync_point(tmp_path, monkeypatch):
    # JAX's notifier owns SIGTERM in a multi-process job: no Python handler,
    # and every batch end asks the sync manager with growing step ids.
    monkeypatch.setattr(_preemption, "_is_multi_process", lambda: True)
    asked = []

    def reached(step_id):
        asked.append(step_id)
        return len(asked) == 6

    monkeypatch.setattr(_preemption.multihost_utils, "reached_preemption_sync_point", reached)
    record = _Sigterm(count=0)
    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(SystemExit) as exit_info:
        _fit(
            _model("plain"), [BackupAndRestore(str(tmp_path), save_before_preemption=True), record]
        )
    assert exit_info.value.code == 42
    assert set(record.handlers) == {before}
    assert asked == list(range(asked[0], asked[0] + 6))
    metadata = _metadata(str(tmp_path))
    assert (metadata["epoch"], metadata["batch"]) == (1, 2)


_SCRIPT = r'''
"""Trains a small model with BackupAndRestore(save_before_preemption=True)."""
import sys
import time

import keras
import numpy as np

from keras_dist.callbacks import BackupAndRestore

X = np.random.RandomState(0).rand(32, 3).astype("float32")
Y = X.sum(axis=1, keepdims=True)


class WaitForSigterm(keras.callbacks.Callback):
    """At the ``at``-th batch end, tells the parent and waits for its SIGTERM to arrive."""

    def __init__(self, backup, at):
        super().__init__()
        self.backup, self.at, self.seen = backup, at, 0

    def on_train_batch_end(self, batch, logs=None):
        self.seen += 1
        if self.seen == self.at:
            print("READY", flush=True)
            deadline = time.monotonic() + 60
            while not self.backup._watcher.requested:
                if time.monotonic() > deadline:
                    sys.exit(3)
                time.sleep(0.005)


def main(backup_dir, out, at, seed):
    keras.utils.set_random_seed(seed)
    model = keras.Sequential([
        keras.Input((3,)), keras.layers.Dense(8, activation="relu"),
        keras.layers.Dropout(0.25), keras.layers.Dense(1),
    ])
    model.compile(keras.optimizers.Adam(0.01), "mse")
    backup = BackupAndRestore(backup_dir, save_before_preemption=True)
    callbacks = [backup] + ([WaitForSigterm(backup, at)] if at else [])
    np.random.seed(7)
    model.fit(X, Y, batch_size=8, epochs=2, callbacks=callbacks, verbose=0)
    np.savez(out, *model.get_weights())


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))
'''


def _run_script(script, log, *args):
    """Starts the script; its stderr goes to ``log`` (a pipe nobody reads could fill up)."""
    with open(log, "w") as stderr:
        return subprocess.Popen(
            [sys.executable, str(script), *map(str, args)],
            stdout=subprocess.PIPE,
            stderr=stderr,
            text=True,
        )


def _weights(path):
    with np.load(path) as arrays:
        return [arrays[f"arr_{i}"] for i in range(len(arrays.files))]


@pytest.mark.timeout(240)
def test_a_process_sent_sigterm_saves_exits_42_and_a_rerun_resumes_exactly(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(_SCRIPT)
    backup_dir = tmp_path / "backup"
    log = tmp_path / "stderr.txt"

    # Preempted at the 5th batch end: the backup is taken at the 6th
    # (epoch 1 after 2 batches), and the process exits with code 42.
    process = _run_script(script, log, backup_dir, tmp_path / "lost.npz", 5, 1)
    try:
        ready = any(line.strip() == "READY" for line in process.stdout)
        assert ready, log.read_text()
        process.send_signal(signal.SIGTERM)
        process.communicate(timeout=120)
    finally:
        process.kill()
    assert process.returncode == 42, log.read_text()
    assert not (tmp_path / "lost.npz").exists()
    metadata = _metadata(str(backup_dir))
    assert (metadata["epoch"], metadata["batch"]) == (1, 2)

    # A restart (other initial weights) resumes and ends as an uninterrupted run.
    rerun = _run_script(script, log, backup_dir, tmp_path / "resumed.npz", 0, 2)
    try:
        rerun.communicate(timeout=120)
    finally:
        rerun.kill()
    assert rerun.returncode == 0, log.read_text()
    assert not os.path.exists(backup_dir)

    namespace = {"__name__": "preemption_script"}
    exec(compile(_SCRIPT, str(script), "exec"), namespace)
    namespace["main"](str(tmp_path / "uninterrupted"), tmp_path / "uninterrupted.npz", 0, 1)
    _assert_equal_arrays(
        _weights(tmp_path / "resumed.npz"), _weights(tmp_path / "uninterrupted.npz")
    )


# --------------------------------------------------------------------------
# TensorBoard.


def _events(run_dir):
    """TensorBoard's own reader of a run (it reads TF 2's tensor summaries)."""
    accumulator = EventAccumulator(str(run_dir), size_guidance={"tensors": 0})
    accumulator.Reload()
    return accumulator


def _series(accumulator, tag):
    events = accumulator.Tensors(tag)
    return [e.step for e in events], [tensor_util.make_ndarray(e.tensor_proto) for e in events]


def _scalar_series(accumulator, tag):
    steps, values = _series(accumulator, tag)
    assert {(v.dtype, v.shape) for v in values} == {(np.dtype("float32"), ())}  # as tf.summary
    return steps, [float(v) for v in values]


def _plugin(accumulator, tag):
    return accumulator.SummaryMetadata(tag).plugin_data.plugin_name


def test_tensorboard_writes_what_history_holds(tmp_path):
    model = _model("mirrored")
    callback = TensorBoard(str(tmp_path), update_freq=2, histogram_freq=2)
    history = _fit(model, [callback], epochs=3, validation_data=(X, Y)).history
    assert sorted(os.listdir(tmp_path)) == ["train", "validation"]

    train = _events(tmp_path / "train")
    for name in ("loss", "mae"):
        steps, values = _scalar_series(train, f"epoch_{name}")
        assert steps == [0, 1, 2]
        np.testing.assert_array_equal(values, np.float32(history[name]))
    assert _plugin(train, "epoch_loss") == "scalars"
    assert _scalar_series(train, "epoch_learning_rate") == ([0, 1, 2], [np.float32(0.01)] * 3)
    steps, values = _scalar_series(train, "batch_loss")
    assert steps == [2, 4, 6, 8, 10, 12]
    np.testing.assert_array_equal(values[1::2], np.float32(history["loss"]))  # epoch ends
    histograms = [tag for tag in train.Tags()["tensors"] if tag.endswith("/histogram")]
    assert len(histograms) == 4  # two kernels and two biases
    assert {_plugin(train, tag) for tag in histograms} == {"histograms"}
    steps, values = _series(train, model.layers[0].kernel.path + "/histogram")
    assert steps == [0, 2]
    # The last one is of the final weights: 30 buckets from min to max, 3 x 8 values.
    final = np.asarray(model.layers[0].kernel, np.float64)
    assert values[1].shape == (30, 3) and values[1].dtype == np.float64
    assert (values[1][0, 0], values[1][-1, 1], values[1][:, 2].sum()) == (
        final.min(),
        final.max(),
        24.0,
    )
    # The model's config for TensorBoard's graph tab, as Keras writes it under TF.
    assert _plugin(train, "keras") == "graph_keras_model"
    (config,) = _series(train, "keras")[1]
    assert json.loads(config[0]) == json.loads(model.to_json())

    validation = _events(tmp_path / "validation")
    steps, values = _scalar_series(validation, "epoch_loss")
    assert steps == [0, 1, 2]
    np.testing.assert_array_equal(values, np.float32(history["val_loss"]))
    steps, values = _scalar_series(validation, "evaluation_loss_vs_iterations")
    assert steps == [4, 8, 12]
    np.testing.assert_array_equal(values, np.float32(history["val_loss"]))


@pytest.mark.parametrize(
    "values, nonzero",
    [
        # TF 2.21's tf.summary.histogram (30 buckets): the (index, left, right, count)
        # rows that hold values. Equal values all go to the last bucket.
        ([0.0, 1.0, 1.0, 3.0], [(0, 0.0, 0.1, 1.0), (10, 1.0, 1.1, 2.0), (29, 2.9, 3.0, 1.0)]),
        ([2.5, 2.5, 2.5], [(29, 2.5, 2.5, 3.0)]),
        ([], []),
    ],
)
def test_histogram_buckets_are_tfs(values, nonzero):
    rows = histogram_bucket_rows(np.float32(values))
    assert rows.shape == (30, 3)
    found = [(int(i), *rows[i]) for i in np.flatnonzero(rows[:, 2])]
    np.testing.assert_allclose(np.reshape(found, (-1, 4)), np.reshape(nonzero, (-1, 4)), atol=1e-12)


def test_tensorboard_writes_nothing_on_a_non_chief(tmp_path, monkeypatch):
    _as_worker(monkeypatch, 1)
    callback = TensorBoard(str(tmp_path / "logs"), update_freq=1, histogram_freq=1)
    _fit(_model("plain"), [callback], epochs=2, validation_data=(X, Y))
    assert not (tmp_path / "logs").exists()


def test_tensorboard_warns_for_what_it_does_not_write():
    with pytest.warns(UserWarning, match="embeddings_freq"):
        TensorBoard("/tmp/unused", embeddings_freq=1)
    with pytest.raises(ValueError, match="update_freq"):
        TensorBoard("/tmp/unused", update_freq="step")


class _SumSummary(keras.layers.Layer):
    """Writes ``sum(x)`` with ``tf.summary`` from inside the model (Keras's own test does)."""

    def call(self, x):
        import tensorflow as tf  # only in the test that has it

        # tf.summary.write is a no-op without a writer (Keras traces `call` before fit).
        tf.summary.write("custom_summary", keras.ops.sum(x))
        return x


def test_summaries_written_inside_replicas_reach_keras_tensorboard_once(tmp_path):
    # TF's MirroredStrategy hands its writer to the replica threads and records on
    # replica 0: each step writes the summary once, with one device's step numbers.
    pytest.importorskip("tensorflow")

    def summary_steps(kind):
        with _scope(kind):
            model = keras.Sequential([keras.Input((3,)), _SumSummary(), keras.layers.Dense(1)])
            # tf.summary takes values, not traced arrays: Keras's test runs it this way too.
            model.compile("sgd", "mse", jit_compile=False)
        callback = keras.callbacks.TensorBoard(str(tmp_path / kind), update_freq=1)
        model.fit(X, Y, batch_size=8, epochs=2, shuffle=False, callbacks=[callback], verbose=0)
        events = EventAccumulator(str(tmp_path / kind / "train"), size_guidance={"tensors": 0})
        events.Reload()
        return [(e.step, e.tensor_proto.float_val) for e in events.Tensors("custom_summary")]

    plain = summary_steps("plain")
    assert len(plain) == 8
    assert summary_steps("mirrored") == plain


# --------------------------------------------------------------------------
# ModelCheckpoint(save_best_only=True) across a restart (keras-team/keras#17012 and
# keras-team/tf-keras#430: a restarted run saved its first epoch, however bad).


class _Score(keras.callbacks.Callback):
    """Puts a chosen value into each epoch's logs, as a validation metric would."""

    SCORES = [1.0, 0.5, 0.9, 0.8]  # best at epoch 1 (file best_2); no better after it

    def on_epoch_end(self, epoch, logs=None):
        logs["score"] = self.SCORES[epoch]


@pytest.mark.parametrize("kind", ["plain", "mirrored"])
@pytest.mark.parametrize("checkpoint_first", [True, False])
def test_model_checkpoint_best_survives_a_restart(tmp_path, kind, checkpoint_first):
    def callbacks(backup_dir):
        checkpoint = ModelCheckpoint(
            str(tmp_path / "best_{epoch}.weights.h5"),
            monitor="score",
            mode="min",
            save_best_only=True,
            save_weights_only=True,
        )
        backup = BackupAndRestore(backup_dir)
        return (
            [_Score(), checkpoint, backup] if checkpoint_first else [_Score(), backup, checkpoint]
        )

    backup_dir = str(tmp_path / "backup")
    np.random.seed(SHUFFLE_SEED)
    with pytest.raises(RuntimeError, match="interrupted"):
        _fit(_model(kind), [*callbacks(backup_dir), _InterruptAtEpochEnd(1)])
    assert sorted(f for f in os.listdir(tmp_path) if f.endswith(".h5")) == [
        "best_1.weights.h5",
        "best_2.weights.h5",
    ]
    # A new process: a new model and new callbacks, resumed from the backup at epoch 2.
    history = _fit(_model(kind, seed=2), callbacks(backup_dir))
    assert history.epoch == [2, 3]
    # Epochs 2 and 3 (scores 0.9, 0.8) are worse than 0.5: no file, the best one kept.
    assert sorted(f for f in os.listdir(tmp_path) if f.endswith(".h5")) == [
        "best_1.weights.h5",
        "best_2.weights.h5",
    ]


# A batch-frequency ModelCheckpoint across a mid-epoch resume: the backup (every 5
# batches) is taken at the end of the 10th, in epoch 2 after 2 of its 4 batches; the
# checkpoint saves every 3 batches (3, 6, 9, 12, 15), so the resumed run replays 2
# batches and must count them once, and its first save (12) compares with the best of 9.


def _checkpoint_files(directory, kind):
    """``{file name: weights}`` of the ``.weights.h5`` files in ``directory``."""
    files = {}
    for name in sorted(os.listdir(directory)):
        model = _model(kind)
        model.load_weights(os.path.join(directory, name))
        files[name] = model.get_weights()
    return files


@pytest.mark.parametrize("checkpoint_first", [True, False])
@pytest.mark.parametrize("save_best_only", [False, True])
def test_a_batch_frequency_checkpoint_saves_as_an_uninterrupted_run_after_a_resume(
    tmp_path, checkpoint_first, save_best_only
):
    kind = "mirrored"

    def callbacks(run):
        checkpoint = ModelCheckpoint(
            str(tmp_path / run / "w-{epoch:02d}-{batch:02d}.weights.h5"),
            monitor="loss",
            save_freq=3,
            save_best_only=save_best_only,
            save_weights_only=True,
        )
        backup = BackupAndRestore(str(tmp_path / f"backup-{run}"), save_freq=5)
        return [checkpoint, backup] if checkpoint_first else [backup, checkpoint]

    np.random.seed(SHUFFLE_SEED)
    _fit(_model(kind), callbacks("uninterrupted"))
    np.random.seed(SHUFFLE_SEED)
    with pytest.raises(RuntimeError, match="interrupted"):
        _fit(_model(kind), [*callbacks("resumed"), _InterruptAtBatch(11)])
    history = _fit(_model(kind, seed=2), callbacks("resumed"))
    assert history.epoch == [2, 3]

    expected = _checkpoint_files(tmp_path / "uninterrupted", kind)
    found = _checkpoint_files(tmp_path / "resumed", kind)
    if not save_best_only:
        assert list(expected) == [f"w-0{e}-0{b}.weights.h5" for e, b in CHECKPOINTED_AT]
    assert list(found) == list(expected)
    for name, weights in expected.items():
        _assert_equal_arrays(found[name], weights)


CHECKPOINTED_AT = [(1, 3), (2, 2), (3, 1), (3, 4), (4, 3)]  # Keras's 1-based names
