"""What monitoring callbacks remember, kept in a ``BackupAndRestore`` backup.

``ModelCheckpoint(save_best_only=True)`` saves only when the monitored value beats the
best it has seen. A restarted process builds a new callback, whose best is the initial
one again, so Keras and tf.keras overwrite the best checkpoint with the first epoch after
the restart, however bad (keras-team/keras#17012, keras-team/tf-keras#430). The backup
keeps each such callback's best, and the restore gives it back.

>>> import keras
>>> before = keras.callbacks.ModelCheckpoint("m.keras", save_best_only=True)
>>> before.best = 0.25
>>> after = keras.callbacks.ModelCheckpoint("m.keras", save_best_only=True)
>>> restore([after], states([before]))
>>> after.best
0.25
"""

import keras


def _remembering(callbacks) -> dict:
    """The callbacks that remember a best value, by a key that a restarted run gives them too."""
    found = {}
    for callback in callbacks:
        if isinstance(callback, keras.callbacks.ModelCheckpoint) and callback.save_best_only:
            key = f"ModelCheckpoint:{callback.monitor}:{callback.filepath}"
            while key in found:  # two alike: told apart by their order
                key += "+"
            found[key] = callback
    return found


def states(callbacks) -> dict:
    """``{key: {"best": value}}`` for the callbacks among ``callbacks`` that remember one."""
    return {
        key: {"best": None if callback.best is None else float(callback.best)}
        for key, callback in _remembering(callbacks).items()
    }


def restore(callbacks, saved: dict, epoch_logs=None) -> None:
    """Gives each callback among ``callbacks`` the best value ``saved`` holds for it.

    ``epoch_logs`` are the logs of the epoch whose end the backup was taken at: a callback
    listed after ``BackupAndRestore`` saw them only after the backup was written, so its
    best is brought up to date with them here (where its direction is known).
    """
    for key, callback in _remembering(callbacks).items():
        if key not in saved:
            continue
        best = saved[key]["best"]
        value = (epoch_logs or {}).get(callback.monitor)
        if value is not None and callback.save_freq == "epoch" and _improves(callback, value, best):
            best = float(value)
        callback.best = best


def _improves(callback, value, best) -> bool:
    """Keras's test of an improvement, for the directions known without the model."""
    if best is None:
        return True
    mode = callback.mode
    if mode == "auto" and callback.monitor.endswith("loss"):
        mode = "min"
    margin = abs(callback.min_delta)
    if mode == "min":
        return value + margin < best
    if mode == "max":
        return value - margin > best
    return False
