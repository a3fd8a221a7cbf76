"""The files of a training backup, and what they hold beyond ``model.save_weights``.

``model.save_weights`` keeps the weights and the optimizer's variables (its
slots and iteration counter). Resuming exactly also needs what it leaves out:

* the model's non-trainable variables (the state of a ``Dropout``'s seed
  generator is one, and Keras does not save it),
* the metrics' variables, so that an epoch resumed mid-way reports what an
  uninterrupted one does,
* NumPy's global random state at the start of the epoch to resume: Keras
  shuffles arrays with ``np.random.permutation`` when an epoch starts,
* where to resume (``epoch``, and ``batch``: how many batches of that epoch
  are trained) and the last logs, shown for the batches skipped on resume.

A backup is one directory, replaced as a unit. A save writes a new directory
beside it (``<dir>.staging-<id>``): the weights, the state, and last the metadata
with every file's SHA-256 and a digest of itself, each fsynced. Then the old directory is renamed
aside, the new one into its place, and the old one removed (or, with
``double_checkpoint``, kept as ``<dir>.previous``). A process killed at any
moment leaves either the old backup, the new one, or both complete; a restore
verifies the digest and the checksums and falls back to the next complete copy
when one cannot be read. A copy whose metadata is missing or was edited cannot
be read: it must not restart training, or skip it, unnoticed.
"""

import dataclasses
import glob
import hashlib
import json
import os
import uuid
import zipfile

import numpy as np

from keras_dist import _atomic_files

WEIGHTS = "latest.weights.h5"
STATE = "training_state.npz"
METADATA = "training_metadata.json"
PREVIOUS = ".previous"  # the backup before the latest, kept with ``double_checkpoint``
_STAGING = ".staging-"  # a backup being written
_RETIRING = ".retiring-"  # the replaced backup, between the two renames
_DELETING = ".deleting-"  # a copy being deleted: never read
DIGEST = "digest"  # the metadata's field: SHA-256 of the rest (``_digest``)
# What a backup that cannot be decoded raises (h5py raises OSError or RuntimeError).
_UNREADABLE = (
    OSError,
    RuntimeError,
    ValueError,
    KeyError,
    EOFError,
    zipfile.BadZipFile,
    json.JSONDecodeError,
    UnicodeDecodeError,
)


class BackupUnreadableError(RuntimeError):
    """No copy of a training backup could be read."""


class _ChecksumMismatch(ValueError):
    pass


@dataclasses.dataclass
class Restored:
    """A backup read back: where to resume, and what to restore when the epoch starts."""

    epoch: int
    batch: int
    batches_since_save: int
    logs: dict
    metrics: list
    callback_states: dict  # ``_monitor_state.states``: what monitoring callbacks remember


def _scalar_logs(logs) -> dict:
    out = {}
    for name, value in (logs or {}).items():
        if np.ndim(value) == 0:
            out[name] = float(np.asarray(value))
    return out


def save(
    model,
    dirpath,
    *,
    epoch,
    batch,
    batches_since_save,
    logs,
    rng_state,
    double_checkpoint,
    callback_states=None,
):
    """Writes a backup of ``model`` as the directory ``dirpath``, replacing it as a unit.

    Every process calls this (non-chiefs into a directory they remove after).
    """
    dirpath = os.path.abspath(dirpath)
    os.makedirs(os.path.dirname(dirpath), exist_ok=True)
    staging = f"{dirpath}{_STAGING}{uuid.uuid4().hex[:12]}"
    os.makedirs(staging)
    try:
        _write(model, staging, epoch, batch, batches_since_save, logs, rng_state, callback_states)
        _install(staging, dirpath, keep_previous=double_checkpoint)
    finally:
        _atomic_files.remove_tree(staging)  # gone already unless something failed


def _write(model, staging, epoch, batch, batches_since_save, logs, rng_state, callback_states):
    weights = os.path.join(staging, WEIGHTS)
    model.save_weights(weights, overwrite=True)
    arrays = {}
    for i, variable in enumerate(model.non_trainable_variables):
        arrays[f"non_trainable_{i}"] = np.asarray(variable)
    for i, variable in enumerate(model.metrics_variables):
        arrays[f"metrics_{i}"] = np.asarray(variable)
    _, keys, position, has_gauss, cached_gaussian = rng_state
    arrays["rng_keys"] = np.asarray(keys)
    arrays["rng_rest"] = np.asarray([position, has_gauss, cached_gaussian], dtype=np.float64)
    state = os.path.join(staging, STATE)
    with open(state, "wb") as f:
        np.savez(f, **arrays)
    for path in (weights, state):
        _atomic_files.fsync_file(path)
    metadata = {
        "epoch": int(epoch),
        "batch": int(batch),
        "batches_since_save": int(batches_since_save),
        "logs": _scalar_logs(logs),
        "callback_states": callback_states or {},
        "sha256": {
            name: _atomic_files.sha256(os.path.join(staging, name)) for name in (WEIGHTS, STATE)
        },
    }
    metadata[DIGEST] = _digest(metadata)
    _atomic_files.write_json(os.path.join(staging, METADATA), metadata)
    _atomic_files.fsync_dir(staging)


def _install(staging, dirpath, keep_previous):
    """Puts the complete backup ``staging`` in place of ``dirpath``."""
    parent = os.path.dirname(dirpath)
    retiring = f"{dirpath}{_RETIRING}{uuid.uuid4().hex[:12]}"
    if os.path.exists(dirpath):
        os.rename(dirpath, retiring)
    os.rename(staging, dirpath)
    _atomic_files.fsync_dir(parent)
    if os.path.exists(retiring):
        if keep_previous:
            _atomic_files.remove_tree(dirpath + PREVIOUS)
            os.rename(retiring, dirpath + PREVIOUS)
        else:
            _atomic_files.remove_tree(retiring)
        _atomic_files.fsync_dir(parent)
    leftovers = _siblings(dirpath, _STAGING) + _siblings(dirpath, _RETIRING)
    for leftover in leftovers + _siblings(dirpath, _DELETING):
        _atomic_files.remove_tree(leftover)  # from saves and deletes killed part-way


def _siblings(dirpath, mark) -> list:
    """``<dirpath><mark>*`` directories, newest first."""
    found = glob.glob(glob.escape(dirpath + mark) + "*")
    return sorted(found, key=os.path.getmtime, reverse=True)


def _candidates(dirpath) -> list:
    """Every complete-looking copy of the backup, the newest first.

    The latest is ``dirpath``; a save killed between its two renames leaves
    the new copy staged and the old one retiring; ``double_checkpoint`` keeps
    the previous one.
    """
    staged = [c for c in _siblings(dirpath, _STAGING) if os.path.exists(os.path.join(c, METADATA))]
    copies = [dirpath] + staged + _siblings(dirpath, _RETIRING) + [dirpath + PREVIOUS]
    # A staging copy gets its metadata last: without it, it is a save cut short.
    # The others were complete when renamed into place: without it, one is damaged.
    return [c for c in copies if os.path.isdir(c)]


def load(model, dirpath, *, double_checkpoint) -> "Restored | None":
    """Restores the backup in ``dirpath`` into ``model`` and NumPy; ``None`` if there is none.

    A copy that cannot be read (a checksum that does not match, a decoder
    error) is skipped for the next complete one; if none can be read, raises
    ``BackupUnreadableError`` naming the directory and what to do.
    """
    dirpath = os.path.abspath(dirpath)
    candidates = _candidates(dirpath)
    if not candidates:
        return None
    failures = []
    for candidate in candidates:
        intact = False
        try:
            intact = _verify(candidate)
            return _load(model, candidate)
        except BackupMismatchError:
            raise
        except _UNREADABLE as error:
            if intact and isinstance(error, ValueError):
                # Its files are as written: the model differs, not the backup.
                raise BackupMismatchError(
                    f"The backup in {candidate!r} is intact but does not fit this model: "
                    "it was written by another model or compile() configuration. Resume "
                    "with the same model, or give `backup_dir` a new directory. Received: "
                    f"{type(error).__name__}: {error}"
                ) from error
            failures.append(f"{candidate}: {type(error).__name__}: {error}")
    raise BackupUnreadableError(
        f"The training backup in {os.path.dirname(dirpath)!r} cannot be read: every copy "
        "is damaged. Delete that directory to train from the start (or restore it from "
        "a copy of your own). Received: " + "; ".join(failures)
    )


def _digest(metadata) -> str:
    """The SHA-256 of the metadata but its digest: where to resume, and every file's SHA-256.

    One digest covers the whole backup: the metadata holds the files' checksums.
    """
    fields = {name: value for name, value in metadata.items() if name != DIGEST}
    return hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()


def _verify(candidate) -> bool:
    """Checks the copy's digest and files; raises if the metadata is missing or any differs.

    The metadata says where to resume: a copy whose metadata was deleted or
    edited by hand would restart training, or skip it, without a word.
    """
    path = os.path.join(candidate, METADATA)
    if not os.path.exists(path):
        raise _ChecksumMismatch(f"{METADATA} is missing")
    metadata = _atomic_files.read_json(path)
    if not isinstance(metadata, dict) or metadata.get(DIGEST) != _digest(metadata):
        raise _ChecksumMismatch(f"{METADATA} does not match its digest (was it edited?)")
    for name in (WEIGHTS, STATE):
        actual = _atomic_files.sha256(os.path.join(candidate, name))
        if actual != metadata["sha256"].get(name):
            raise _ChecksumMismatch(f"{name} does not match its checksum")
    return True


def _load(model, dirpath) -> Restored:
    metadata = _atomic_files.read_json(os.path.join(dirpath, METADATA))
    if model.optimizer is not None and not model.optimizer.built:
        # The optimizer's variables must exist for its saved ones to load.
        model.optimizer.build(model.trainable_variables)
    model.load_weights(os.path.join(dirpath, WEIGHTS))
    with np.load(os.path.join(dirpath, STATE)) as arrays:
        non_trainable = _numbered(arrays, "non_trainable_")
        metrics = _numbered(arrays, "metrics_")
        keys, rest = arrays["rng_keys"], arrays["rng_rest"]
    _check_count("non-trainable", non_trainable, model.non_trainable_variables, dirpath)
    for variable, value in zip(model.non_trainable_variables, non_trainable):
        variable.assign(value)
    np.random.set_state(("MT19937", keys, int(rest[0]), int(rest[1]), float(rest[2])))
    return Restored(
        epoch=metadata["epoch"],
        batch=metadata["batch"],
        batches_since_save=metadata["batches_since_save"],
        logs=metadata["logs"],
        metrics=metrics,
        callback_states=metadata.get("callback_states", {}),
    )


def restore_metrics(model, values, dirpath) -> None:
    """Puts the metrics' saved values back (after ``fit`` reset them for the epoch)."""
    _check_count("metric", values, model.metrics_variables, dirpath)
    for variable, value in zip(model.metrics_variables, values):
        variable.assign(value)


def _numbered(arrays, prefix) -> list:
    count = sum(1 for name in arrays.files if name.startswith(prefix))
    return [arrays[f"{prefix}{i}"] for i in range(count)]


class BackupMismatchError(ValueError):
    """A readable backup of another model: not a damaged copy to skip."""


def _check_count(kind, values, variables, dirpath):
    if len(values) != len(variables):
        raise BackupMismatchError(
            f"The backup in {dirpath!r} holds {len(values)} {kind} variables but the model "
            f"has {len(variables)}: it was written by another model or compile() "
            "configuration. Resume with the same model, or delete the backup directory. "
            f"Received: {kind} variables={len(variables)}"
        )


def delete(dirpath) -> None:
    """Removes a backup and every copy of it, the latest first (a reader then finds none).

    Each copy is renamed aside whole before it is removed: a process killed
    part-way leaves whole copies or none, never one without its metadata.
    """
    dirpath = os.path.abspath(dirpath)
    copies = [dirpath] + _siblings(dirpath, _STAGING) + _siblings(dirpath, _RETIRING)
    for copy in copies + [dirpath + PREVIOUS]:
        if os.path.exists(copy):
            deleting = f"{dirpath}{_DELETING}{uuid.uuid4().hex[:12]}"
            os.rename(copy, deleting)
            _atomic_files.remove_tree(deleting)
    for leftover in _siblings(dirpath, _DELETING):
        _atomic_files.remove_tree(leftover)
