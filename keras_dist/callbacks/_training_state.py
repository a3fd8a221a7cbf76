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

The metadata file is written last: a backup without it is not read.
"""

import dataclasses
import json
import os
import shutil

import numpy as np

WEIGHTS = "latest.weights.h5"
STATE = "training_state.npz"
METADATA = "training_metadata.json"
_FILES = (WEIGHTS, STATE, METADATA)
_BACKUP_SUFFIX = ".bkp"


@dataclasses.dataclass
class Restored:
    """A backup read back: where to resume, and what to restore when the epoch starts."""

    epoch: int
    batch: int
    batches_since_save: int
    logs: dict
    metrics: list


def _scalar_logs(logs) -> dict:
    out = {}
    for name, value in (logs or {}).items():
        if np.ndim(value) == 0:
            out[name] = float(np.asarray(value))
    return out


def save(model, dirpath, *, epoch, batch, batches_since_save, logs, rng_state, double_checkpoint):
    """Writes a backup of ``model`` into ``dirpath`` (every process calls this)."""
    os.makedirs(dirpath, exist_ok=True)
    paths = [os.path.join(dirpath, name) for name in _FILES]
    if double_checkpoint:
        for path in paths:
            if os.path.exists(path):
                shutil.copyfile(path, path + _BACKUP_SUFFIX)
    model.save_weights(paths[0], overwrite=True)
    arrays = {}
    for i, variable in enumerate(model.non_trainable_variables):
        arrays[f"non_trainable_{i}"] = np.asarray(variable)
    for i, variable in enumerate(model.metrics_variables):
        arrays[f"metrics_{i}"] = np.asarray(variable)
    _, keys, position, has_gauss, cached_gaussian = rng_state
    arrays["rng_keys"] = np.asarray(keys)
    arrays["rng_rest"] = np.asarray([position, has_gauss, cached_gaussian], dtype=np.float64)
    with open(paths[1], "wb") as f:
        np.savez(f, **arrays)
    metadata = {
        "epoch": int(epoch),
        "batch": int(batch),
        "batches_since_save": int(batches_since_save),
        "logs": _scalar_logs(logs),
    }
    with open(paths[2], "w") as f:
        json.dump(metadata, f)


def load(model, dirpath, *, double_checkpoint) -> "Restored | None":
    """Restores the backup in ``dirpath`` into ``model`` and NumPy; ``None`` if there is none.

    With ``double_checkpoint``, a backup that fails to load is replaced by the
    previous one.
    """
    if not os.path.exists(os.path.join(dirpath, METADATA)):
        return None
    try:
        return _load(model, dirpath)
    except (OSError, ValueError, KeyError):
        previous = [os.path.join(dirpath, name + _BACKUP_SUFFIX) for name in _FILES]
        if not double_checkpoint or not all(os.path.exists(p) for p in previous):
            raise
        for path in previous:
            shutil.copyfile(path, path[: -len(_BACKUP_SUFFIX)])
        return _load(model, dirpath)


def _load(model, dirpath) -> Restored:
    with open(os.path.join(dirpath, METADATA)) as f:
        metadata = json.load(f)
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
    )


def restore_metrics(model, values, dirpath) -> None:
    """Puts the metrics' saved values back (after ``fit`` reset them for the epoch)."""
    _check_count("metric", values, model.metrics_variables, dirpath)
    for variable, value in zip(model.metrics_variables, values):
        variable.assign(value)


def _numbered(arrays, prefix) -> list:
    count = sum(1 for name in arrays.files if name.startswith(prefix))
    return [arrays[f"{prefix}{i}"] for i in range(count)]


def _check_count(kind, values, variables, dirpath):
    if len(values) != len(variables):
        raise ValueError(
            f"The backup in {dirpath!r} holds {len(values)} {kind} variables but the model "
            f"has {len(variables)}: it was written by another model or compile() "
            "configuration. Resume with the same model, or delete the backup directory. "
            f"Received: {kind} variables={len(variables)}"
        )


def delete(dirpath) -> None:
    """Removes a backup, its metadata first, so that a reader never sees half of one."""
    metadata = os.path.join(dirpath, METADATA)
    if os.path.exists(metadata):
        os.remove(metadata)
    shutil.rmtree(dirpath, ignore_errors=True)
