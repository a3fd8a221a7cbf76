"""Checkpoints survive being killed while they are written.

A process killed with SIGKILL at a random moment of a ``save_freq=1`` run must
never make the restart fail, nor resume from half of one backup and half of
another: the run that finally completes ends with the weights of a run that
was never interrupted. A damaged backup (its metadata deleted or edited too)
falls back to the previous copy, or fails with one clear error naming the
directory.
"""

import json
import os
import random
import signal
import subprocess
import sys
import time

import keras
import numpy as np
import pytest
from conftest import cpus

import keras_dist as kd
from keras_dist.callbacks import BackupAndRestore
from keras_dist.callbacks import ModelCheckpoint
from keras_dist.callbacks import _training_state
from keras_dist.callbacks import _writer_role
from keras_dist.cluster_resolver import ClusterSpec

_SCRIPT = r'''
"""Trains under MirroredStrategy with BackupAndRestore(save_freq=1), then saves the weights."""
import os
import sys

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2"
import keras_dist as kd  # noqa: E402
import keras  # noqa: E402
import numpy as np  # noqa: E402

rng = np.random.RandomState(0)
X = rng.rand(96, 6).astype("float32")
Y = (X @ rng.rand(6, 1)).astype("float32")


EPOCHS = 40


class Training(keras.callbacks.Callback):
    """Tells the parent when the first step of this run is done."""

    def __init__(self):
        super().__init__()
        self.told = False

    def on_train_batch_end(self, batch, logs=None):
        if not self.told:
            print("TRAINING", flush=True)
            self.told = True


def main(backup_dir, out):
    keras.utils.set_random_seed(3)
    strategy = kd.MirroredStrategy(["/cpu:0", "/cpu:1"])
    with strategy.scope():
        model = keras.Sequential([
            keras.Input((6,)), keras.layers.Dense(32, activation="relu"),
            keras.layers.Dropout(0.1), keras.layers.Dense(1),
        ])
        model.compile(keras.optimizers.Adam(0.01), "mse")
    backup = kd.callbacks.BackupAndRestore(backup_dir, save_freq=1, delete_checkpoint=False)
    model.fit(X, Y, batch_size=8, epochs=EPOCHS, callbacks=[backup, Training()], verbose=0)
    np.savez(out, *model.get_weights())


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
'''


def _start(script, backup_dir, out, log):
    with open(log, "a") as stderr:
        return subprocess.Popen(
            [sys.executable, str(script), str(backup_dir), str(out)],
            stdout=subprocess.PIPE,
            stderr=stderr,
            text=True,
        )


def _weights(path):
    with np.load(path) as arrays:
        return [arrays[f"arr_{i}"] for i in range(len(arrays.files))]


def _finish(process, log, timeout=300):
    try:
        process.wait(timeout=timeout)
    finally:
        if process.poll() is None:
            process.kill()
    assert process.returncode == 0, open(log).read()


@pytest.mark.stress
def test_ten_sigkills_while_saving_every_step_never_break_the_resume(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(_SCRIPT)
    log = tmp_path / "log.txt"
    reference = tmp_path / "reference.npz"
    _finish(_start(script, tmp_path / "uninterrupted", reference, log), log)

    backup_dir, out = tmp_path / "backup", tmp_path / "resumed.npz"
    rng = random.Random(20261122)
    killed = 0
    for _ in range(10):
        process = _start(script, backup_dir, out, log)
        line = process.stdout.readline()  # "TRAINING": this run trained its first step
        if not line:  # the run ended before a step: it had nothing left to train
            process.wait(timeout=60)
            assert process.returncode == 0, open(log).read()
            break
        time.sleep(rng.uniform(0.0, 0.6))
        if process.poll() is None:
            process.send_signal(signal.SIGKILL)
            killed += 1
        process.wait(timeout=60)
        # Killed, or it finished the run: never an error of its own.
        assert process.returncode in (0, -signal.SIGKILL), open(log).read()
        if process.returncode == 0:
            break
    assert killed >= 8
    if not out.exists():
        _finish(_start(script, backup_dir, out, log), log)
    for got, expected in zip(_weights(out), _weights(reference)):
        np.testing.assert_allclose(got, expected, rtol=1e-6, atol=1e-7)


def _model(strategy):
    with strategy.scope():
        model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(4), keras.layers.Dense(1)])
        model.compile(keras.optimizers.Adam(0.01), "mse")
    return model


def _fit(model, callbacks, epochs):
    x = np.random.RandomState(1).rand(16, 3).astype("float32")
    return model.fit(x, x.sum(1), batch_size=4, epochs=epochs, callbacks=callbacks, verbose=0)


@pytest.mark.parametrize(
    "damage",
    [
        ("latest.weights.h5", b"not an h5 file"),
        ("latest.weights.h5", b""),
        ("training_state.npz", b"PK\x03\x04 truncated"),
        ("training_state.npz", b""),
        ("training_metadata.json", b'{"epoch": 2, "batch'),
        ("training_metadata.json", b"\xff\xfe\x00"),
    ],
    ids=lambda d: f"{d[0]}={d[1][:8]!r}",
)
def test_a_damaged_latest_backup_falls_back_to_the_previous_one(tmp_path, damage):
    strategy = kd.MirroredStrategy(cpus(2))
    backup = BackupAndRestore(str(tmp_path), delete_checkpoint=False, double_checkpoint=True)
    _fit(_model(strategy), [backup], epochs=2)
    name, data = damage
    (tmp_path / "chief" / name).write_bytes(data)
    # The previous copy is the end of epoch 1: training resumes with epoch 2.
    assert _fit(_model(strategy), [backup], epochs=3).epoch == [1, 2]


def test_a_backup_with_no_readable_copy_names_its_directory(tmp_path):
    strategy = kd.MirroredStrategy(cpus(2))
    backup = BackupAndRestore(str(tmp_path), delete_checkpoint=False)
    _fit(_model(strategy), [backup], epochs=1)
    (tmp_path / "chief" / "training_state.npz").write_bytes(b"")
    with pytest.raises(_training_state.BackupUnreadableError) as error:
        _fit(_model(strategy), [backup], epochs=2)
    message = str(error.value)
    assert str(tmp_path) in message and "Delete that directory" in message
    assert "training_state.npz does not match its checksum" in message


def _edit_metadata(backup_dir, **fields):
    path = backup_dir / "chief" / _training_state.METADATA
    metadata = json.loads(path.read_text())
    metadata.update(fields)
    path.write_text(json.dumps(metadata))


@pytest.mark.parametrize(
    "damage, reason",
    [
        ("deleted", "training_metadata.json is missing"),
        ({"epoch": 99}, "training_metadata.json does not match its digest"),
        ({"batch": 77}, "training_metadata.json does not match its digest"),
        ({"digest": "0" * 64}, "training_metadata.json does not match its digest"),
    ],
    ids=["deleted", "epoch=99", "batch=77", "digest"],
)
def test_a_missing_or_edited_metadata_file_is_unreadable_not_a_silent_restart(
    tmp_path, damage, reason
):
    strategy = kd.MirroredStrategy(cpus(2))
    backup = BackupAndRestore(str(tmp_path), save_freq=2, delete_checkpoint=False)
    _fit(_model(strategy), [backup], epochs=2)  # the last backup: epoch 1, batch 4 of 4
    if damage == "deleted":
        os.remove(tmp_path / "chief" / _training_state.METADATA)
    else:
        _edit_metadata(tmp_path, **damage)
    model = _model(strategy)
    before = model.get_weights()
    with pytest.raises(_training_state.BackupUnreadableError) as error:
        _fit(model, [backup], epochs=3)
    message = str(error.value)
    assert reason in message and str(tmp_path) in message and "Delete that directory" in message
    for got, expected in zip(model.get_weights(), before):
        np.testing.assert_array_equal(got, expected)  # nothing trained


@pytest.mark.parametrize("damage", ["deleted", "edited"])
def test_a_missing_or_edited_latest_metadata_falls_back_to_the_previous_backup(tmp_path, damage):
    strategy = kd.MirroredStrategy(cpus(2))
    backup = BackupAndRestore(str(tmp_path), delete_checkpoint=False, double_checkpoint=True)
    _fit(_model(strategy), [backup], epochs=2)
    if damage == "deleted":
        os.remove(tmp_path / "chief" / _training_state.METADATA)
    else:
        _edit_metadata(tmp_path, epoch=99)
    # The previous copy is the end of epoch 1: training resumes with epoch 2.
    assert _fit(_model(strategy), [backup], epochs=3).epoch == [1, 2]


def test_a_delete_killed_part_way_leaves_no_copy_without_its_metadata(tmp_path):
    strategy = kd.MirroredStrategy(cpus(2))
    backup = BackupAndRestore(str(tmp_path), delete_checkpoint=False, double_checkpoint=True)
    _fit(_model(strategy), [backup], epochs=2)
    # What a delete killed after its rename leaves: a copy set aside, never read.
    os.rename(tmp_path / "chief", tmp_path / "chief.deleting-0123")
    os.rename(tmp_path / "chief.previous", tmp_path / "chief.deleting-4567")
    assert _fit(_model(strategy), [backup], epochs=2).epoch == [0, 1]
    assert sorted(os.listdir(tmp_path)) == ["chief", "chief.previous"]


_KILLED_WORKER = r'''
"""Worker 1 of 2 (as the callbacks see it) SIGKILLs itself inside its second backup."""
import os
import signal
import sys

import keras_dist as kd  # noqa: E402
import keras  # noqa: E402
import numpy as np  # noqa: E402
from keras_dist.callbacks import _training_state, _writer_role  # noqa: E402
from keras_dist.cluster_resolver import ClusterSpec  # noqa: E402

backup_dir, where = sys.argv[1], sys.argv[2]
role = _writer_role.ProcessRole("worker", 1, ClusterSpec({"worker": ["w0:1", "w1:1"]}))
_writer_role.process_role = lambda model: role
saves = []
save = _training_state.save


def save_and_die(model, dirpath, **kwargs):
    saves.append(dirpath)
    if len(saves) == 2 and where == "while_staging":
        model.save_weights = lambda *args, **kw: os.kill(os.getpid(), signal.SIGKILL)
    save(model, dirpath, **kwargs)
    if len(saves) == 2:
        os.kill(os.getpid(), signal.SIGKILL)  # before the temp dir is removed


_training_state.save = save_and_die
model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
model.compile("sgd", "mse")
backup = kd.callbacks.BackupAndRestore(backup_dir, save_freq=1)
model.fit(np.ones((16, 3)), np.ones((16, 1)), batch_size=4, callbacks=[backup], verbose=0)
'''


def _temp_entries(directory) -> list:
    return sorted(n for n in os.listdir(directory) if n.startswith("workertemp_"))


class _ListAtTrainBegin(keras.callbacks.Callback):
    """What is in ``directory`` once the callbacks before it have begun."""

    def __init__(self, directory):
        super().__init__()
        self.directory = directory
        self.seen = None

    def on_train_begin(self, logs=None):
        self.seen = _temp_entries(self.directory)


@pytest.mark.parametrize("next_run", ["same worker", "chief without it"])
@pytest.mark.parametrize("where", ["after_install", "while_staging"])
def test_a_killed_workers_temp_dir_is_removed_by_the_next_run(
    tmp_path, monkeypatch, where, next_run
):
    script = tmp_path / "worker.py"
    script.write_text(_KILLED_WORKER)
    backup_dir = tmp_path / "backup"
    process = subprocess.run(
        [sys.executable, str(script), str(backup_dir), where],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert process.returncode == -signal.SIGKILL, process.stderr
    left = _temp_entries(backup_dir)
    # Its temp dir, and while staging also the half-written copy beside it.
    staged = [name for name in left[1:] if name.startswith("workertemp_1.staging-")]
    assert left[0] == "workertemp_1" and len(staged) == len(left) - 1, left
    assert len(staged) == (where == "while_staging"), left

    if next_run == "same worker":  # its task's next process removes it before training
        role = _writer_role.ProcessRole("worker", 1, ClusterSpec({"worker": ["w0:1", "w1:1"]}))
        monkeypatch.setattr(_writer_role, "process_role", lambda model: role)
    listing = _ListAtTrainBegin(backup_dir)
    _fit(_model(kd.MirroredStrategy(cpus(2))), [BackupAndRestore(str(backup_dir)), listing], 1)
    assert listing.seen == []
    assert not backup_dir.exists()  # a completed fit leaves no backup directory, as Keras's


def test_the_chief_keeps_the_temp_dirs_of_its_jobs_other_workers(tmp_path, monkeypatch):
    for name in ("workertemp_1", "workertemp_2", "workertemp_2.staging-0123", "workertemp_x"):
        os.makedirs(tmp_path / name)
    role = _writer_role.ProcessRole("worker", 0, ClusterSpec({"worker": ["w0:1", "w1:1"]}))
    monkeypatch.setattr(_writer_role, "process_role", lambda model: role)
    listing = _ListAtTrainBegin(tmp_path)
    backup = BackupAndRestore(str(tmp_path), delete_checkpoint=False)
    _fit(_model(kd.MirroredStrategy(cpus(2))), [backup, listing], 1)
    # Worker 1 is in this job (its own process removes its dir); task 2 is not.
    assert listing.seen == ["workertemp_1", "workertemp_x"]


def test_a_backup_of_another_model_is_reported_as_such_not_as_damaged(tmp_path):
    strategy = kd.MirroredStrategy(cpus(2))
    backup = BackupAndRestore(str(tmp_path), delete_checkpoint=False, double_checkpoint=True)
    _fit(_model(strategy), [backup], epochs=2)
    with strategy.scope():
        wider = keras.Sequential([keras.Input((3,)), keras.layers.Dense(8), keras.layers.Dense(1)])
        wider.compile(keras.optimizers.Adam(0.01), "mse")
    with pytest.raises(_training_state.BackupMismatchError) as error:
        _fit(wider, [backup], epochs=3)
    message = str(error.value)
    assert "is intact but does not fit this model" in message and "damaged" not in message
    assert "(3, 4)" in message and "(3, 8)" in message  # Keras's own shape error, quoted
    # Nothing was skipped or changed: the model that wrote it resumes from it.
    assert _fit(_model(strategy), [backup], epochs=3).epoch == [2]


def test_a_save_killed_between_its_renames_resumes_from_a_complete_copy(tmp_path):
    strategy = kd.MirroredStrategy(cpus(2))
    backup = BackupAndRestore(str(tmp_path), delete_checkpoint=False)
    _fit(_model(strategy), [backup], epochs=2)
    chief = tmp_path / "chief"
    # What a kill between "old aside" and "new in place" leaves: no `chief/`, the
    # complete old copy retiring and a half-written staging copy (no metadata).
    os.rename(chief, str(chief) + ".retiring-0123")
    os.makedirs(str(chief) + ".staging-4567")
    (tmp_path / "chief.staging-4567" / "latest.weights.h5").write_bytes(b"half")
    assert _fit(_model(strategy), [backup], epochs=3).epoch == [2]
    assert sorted(os.listdir(tmp_path)) == ["chief"]  # leftovers removed by the next save


def test_model_checkpoint_never_leaves_half_a_file(tmp_path):
    strategy = kd.MirroredStrategy(cpus(2))
    path = tmp_path / "model.keras"
    model = _model(strategy)
    _fit(model, [ModelCheckpoint(str(path))], epochs=1)
    good = path.read_bytes()

    class Crash(Exception):
        pass

    def crashing_save(filepath, *args, **kwargs):
        with open(filepath, "wb") as f:
            f.write(b"half of a zip")
        raise Crash()

    model.save = crashing_save  # Keras's writer dies part-way
    with pytest.raises(Crash):
        _fit(model, [ModelCheckpoint(str(path))], epochs=1)
    assert path.read_bytes() == good
    assert sorted(os.listdir(tmp_path)) == ["model.keras"]  # no temporary file left
    assert keras.saving.load_model(path).count_params() == model.count_params()
