"""Callbacks and Keras's loops: what they hold when a loop fails, and Keras's private counts.

Keras calls a callback's end hooks (``on_train_end``, ``on_test_end``,
``on_predict_end``) only when its loop returns. A callback that holds writers,
threads or files from its begin hook on is a ``HoldsResources``: when ``fit``,
``evaluate`` or ``predict`` raises, the trainer hooks call its
``release_resources`` instead (``release_after_error``).

What Keras's ``ModelCheckpoint`` keeps to itself, read and set for ``BackupAndRestore``:

A resumed ``fit`` builds new callbacks. To save at the batches and compare with the
best value an uninterrupted run would, a ``ModelCheckpoint`` needs back its direction
(``monitor_op``, set by Keras only at an epoch end) and its count of batches since its
last save (Keras's private counter).

>>> import keras
>>> checkpoint = keras.callbacks.ModelCheckpoint("m.keras", save_freq=3, mode="min")
>>> checkpoint_batch_count(checkpoint)
(0, None)
>>> checkpoint_batch_count_through(checkpoint, 1)  # after batches 0 and 1 of an epoch
(2, 1)
>>> set_checkpoint_batch_count(checkpoint, 2, 1)
>>> checkpoint_batch_count(checkpoint)
(2, 1)
"""

import abc
import warnings

import keras

from keras_dist._keras._internals import CallbackList
from keras_dist._keras._internals import History
from keras_dist._keras._internals import ProgbarLogger
from keras_dist._keras._internals import is_default

_OPS = {"min": keras.ops.less, "max": keras.ops.greater}


def checkpoint_batch_count(checkpoint) -> tuple:
    """``(batches since its last save, index of the last batch it saw)``."""
    return checkpoint._batches_seen_since_last_saving, checkpoint._last_batch_seen


def set_checkpoint_batch_count(checkpoint, seen: int, last_batch) -> None:
    """Gives ``checkpoint`` the count ``batch_count`` read."""
    checkpoint._batches_seen_since_last_saving = seen
    checkpoint._last_batch_seen = last_batch


def checkpoint_batch_count_through(checkpoint, batch: int) -> tuple:
    """The count once ``checkpoint`` has seen the end of ``batch``, by Keras's own rule.

    A batch index not above the last one seen starts a new epoch; reaching
    ``save_freq`` saves and starts the count again.
    """
    seen, last = checkpoint_batch_count(checkpoint)
    seen += batch + 1 if last is None or batch <= last else batch - last
    return (0 if seen >= checkpoint.save_freq else seen), batch


def checkpoint_direction(checkpoint) -> "str | None":
    """``"min"`` or ``"max"`` where known without the model's metrics, else ``None``."""
    for name, op in _OPS.items():
        if checkpoint.monitor_op is op:
            return name
    mode = checkpoint.mode
    if mode == "auto" and checkpoint.monitor.removeprefix("val_") == "loss":
        mode = "min"
    return mode if mode in _OPS else None


def set_checkpoint_direction(checkpoint, name: "str | None") -> None:
    """Sets ``monitor_op`` (and ``min_delta``'s sign) as Keras's ``_set_monitor_op`` would."""
    if name is None or checkpoint.monitor_op is not None:
        return
    checkpoint.monitor_op = _OPS[name]
    margin = abs(checkpoint.min_delta)
    checkpoint.min_delta = -margin if name == "min" else margin


class HoldsResources(abc.ABC):
    """A callback that holds writers, threads or files between a loop's begin and end hooks.

    ``release_resources`` is called, once per failed loop, when ``fit``,
    ``evaluate`` or ``predict`` raises (Keras then calls no end hook). It closes
    what the callback holds and keeps what it has written; it may be called
    again (a failed ``evaluate`` inside ``fit`` releases, then ``fit``).
    """

    @abc.abstractmethod
    def release_resources(self) -> None:
        """Closes what the callback holds after a loop that raised; safe to repeat."""


def release_after_error(callbacks) -> None:
    """Calls ``release_resources`` of each ``HoldsResources`` among a failed loop's ``callbacks``.

    ``callbacks``: what the loop was given (a list, a ``CallbackList``, ``None``).
    Every one is released even when one of them fails, which warns: the loop's
    own error is the one to raise.
    """
    if isinstance(callbacks, CallbackList):
        callbacks = callbacks.callbacks
    if not isinstance(callbacks, (list, tuple)):
        return
    for callback in callbacks:
        if isinstance(callback, HoldsResources):
            try:
                callback.release_resources()
            except Exception as error:
                warnings.warn(
                    f"{type(callback).__name__} could not release what it holds after the "
                    f"loop failed. Received: {type(error).__name__}: {error}",
                    stacklevel=3,
                )


def _callback_items(callbacks) -> "list | None":
    """The callbacks a loop was given (a list, or the ``CallbackList`` that ``fit`` hands
    its validation ``evaluate``); ``None`` when they cannot be read."""
    if isinstance(callbacks, CallbackList):
        return callbacks.callbacks
    if callbacks is None:
        return []
    if isinstance(callbacks, (list, tuple)):
        return list(callbacks)
    return None


def quiet_between_steps(callbacks) -> bool:
    """Whether no callback runs code of its own between two steps of a loop.

    Keras's ``History`` and progress bar only read the logs (a copy to the host).
    """
    items = _callback_items(callbacks)
    if items is None:
        return False
    return all(
        isinstance(callback, (History, ProgbarLogger)) or runs_nothing_at(callback, _BATCH_HOOKS)
        for callback in items
    )


def reads_batch_logs(callbacks) -> bool:
    """Whether a callback may read a batch's own logs at that batch's end.

    Steps that run asynchronously (a parameter server's workers) then finish one by
    one, so that the logs are that batch's and not the latest finished one's: TF
    refuses such callbacks under ParameterServerStrategy. The progress bar shows the
    latest values, and a checkpoint or TensorBoard that acts only at an epoch's end
    reads no batch logs.

    >>> import keras
    >>> reads_batch_logs([keras.callbacks.TerminateOnNaN()])
    True
    >>> reads_batch_logs([keras.callbacks.TensorBoard("logs"), keras.callbacks.History()])
    False
    """
    items = _callback_items(callbacks)
    if items is None:
        return True
    return not all(
        isinstance(callback, (History, ProgbarLogger))
        or _acts_at_epochs_only(callback)
        or runs_nothing_at(callback, _BATCH_END_HOOKS)
        for callback in items
    )


def _acts_at_epochs_only(callback) -> bool:
    # Keras's (and keras_dist's) ModelCheckpoint, BackupAndRestore and TensorBoard.
    frequency = getattr(callback, "save_freq", getattr(callback, "update_freq", None))
    return frequency == "epoch"


def runs_nothing_at(callback, hooks) -> bool:
    """Whether each of ``callback``'s ``hooks`` is ``Callback``'s empty default."""
    return all(is_default(getattr(callback, hook, None)) for hook in hooks)


_BATCH_HOOKS = tuple(
    f"on_{loop}batch_{when}"
    for loop in ("", "train_", "test_", "predict_")
    for when in ("begin", "end")
)
_BATCH_END_HOOKS = tuple(hook for hook in _BATCH_HOOKS if hook.endswith("_end"))
