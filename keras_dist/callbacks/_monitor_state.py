"""What ``ModelCheckpoint`` callbacks remember, kept in a ``BackupAndRestore`` backup.

``ModelCheckpoint(save_best_only=True)`` saves only when the monitored value beats the
best it has seen. A restarted process builds a new callback, whose best is the initial
one again, so Keras and tf.keras overwrite the best checkpoint with the first epoch after
the restart, however bad (keras-team/keras#17012, keras-team/tf-keras#430). A
``ModelCheckpoint(save_freq=n)`` saves every ``n`` batches, counted from its last save.
The backup keeps each one's best, its direction and its count of batches, and the
restore gives them back: the resumed run saves the files an uninterrupted run would.

>>> import keras
>>> before = keras.callbacks.ModelCheckpoint("m.keras", save_best_only=True)
>>> before.best = 0.25
>>> after = keras.callbacks.ModelCheckpoint("m.keras", save_best_only=True)
>>> restore([after], states([before]))
>>> after.best
0.25
"""

import keras

from keras_dist._keras import checkpoint_batch_count
from keras_dist._keras import checkpoint_batch_count_through
from keras_dist._keras import checkpoint_direction
from keras_dist._keras import set_checkpoint_batch_count
from keras_dist._keras import set_checkpoint_direction


def _remembering(callbacks) -> dict:
    """The checkpoints that remember a best value or a count of batches, by a key that a
    restarted run gives them too."""
    found = {}
    for callback in callbacks:
        if isinstance(callback, keras.callbacks.ModelCheckpoint) and (
            callback.save_best_only or callback.save_freq != "epoch"
        ):
            key = f"ModelCheckpoint:{callback.monitor}:{callback.filepath}"
            while key in found:  # two alike: told apart by their order
                key += "+"
            found[key] = callback
    return found


def states(callbacks, *, taker=None, batch=None, logs=None) -> dict:
    """``{key: state}`` for the checkpoints among ``callbacks`` (JSON-ready).

    A backup taken by the callback ``taker`` at the end of batch ``batch`` (with that
    batch's ``logs``): the checkpoints listed after ``taker`` have not seen that batch end
    yet, so their state is the one they will have once they have.
    """
    listed = list(callbacks)
    after_taker = listed[listed.index(taker) + 1 :] if taker in listed else []
    found = {}
    for key, callback in _remembering(listed).items():
        best, direction = callback.best, checkpoint_direction(callback)
        count = checkpoint_batch_count(callback)
        if batch is not None and callback.save_freq != "epoch" and callback in after_taker:
            count = checkpoint_batch_count_through(callback, batch)
            value = (logs or {}).get(callback.monitor)
            saves = count[0] == 0
            if saves and callback.save_best_only and value is not None:
                if _improves(direction, callback.min_delta, value, best):
                    best = value
        found[key] = {
            "best": None if best is None else float(best),
            "direction": direction,
            "batch_count": [int(count[0]), None if count[1] is None else int(count[1])],
        }
    return found


def restore(callbacks, saved: dict, epoch_logs=None, replayed_batches=0) -> None:
    """Gives each checkpoint among ``callbacks`` what ``saved`` holds for it.

    ``epoch_logs`` are the logs of the epoch whose end the backup was taken at: a callback
    listed after ``BackupAndRestore`` saw them only after the backup was written, so its
    best is brought up to date with them here. ``replayed_batches``: the batches of the
    resumed epoch that are read again but not trained on (their ends reach the callbacks);
    they count as the batches they are, so none of them is counted twice.
    """
    for key, callback in _remembering(callbacks).items():
        state = saved.get(key)
        if state is None:
            continue
        best, direction = state["best"], state.get("direction")
        value = (epoch_logs or {}).get(callback.monitor)
        if value is not None and callback.save_freq == "epoch":
            if _improves(direction, callback.min_delta, value, best):
                best = float(value)
        callback.best = best
        set_checkpoint_direction(callback, direction)
        count = state.get("batch_count")
        if count is not None and callback.save_freq != "epoch":
            seen, last = count
            if replayed_batches:
                # Keras counts a new epoch's batches from none seen: the replayed ends
                # add ``replayed_batches``, and no save falls among them.
                seen, last = seen - replayed_batches, None
            set_checkpoint_batch_count(callback, seen, last)


def _improves(direction, min_delta, value, best) -> bool:
    """Keras's test of an improvement, where the direction is known."""
    if best is None:
        return True
    margin = abs(min_delta)
    if direction == "min":
        return value + margin < best
    if direction == "max":
        return value - margin > best
    return False
