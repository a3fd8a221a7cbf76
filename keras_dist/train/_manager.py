"""``kd.train.CheckpointManager``: numbered checkpoints in a directory, the oldest deleted.

The manager follows ``tf.train.CheckpointManager``: ``save`` writes
``<directory>/<checkpoint_name>-<n>``, records it in the directory's
``checkpoint`` file, deletes the oldest checkpoints beyond ``max_to_keep``
(keeping one every ``keep_checkpoint_every_n_hours``) and records the list
again. The state is written only once the checkpoint is complete and before
anything is deleted, so a process killed at any moment leaves a ``checkpoint``
file that names a whole checkpoint.

On several workers only the chief writes in ``directory`` and deletes old
checkpoints; the others write theirs into a temporary directory they remove
(see ``_checkpoint.write_checkpoint``) and keep the same list in memory.
"""

import collections
import glob
import logging
import os
import time

from keras_dist import _atomic_files
from keras_dist.train import _format
from keras_dist.train import _objects
from keras_dist.train import _state
from keras_dist.train._checkpoint import Checkpoint
from keras_dist.train._checkpoint import wait_for_writer
from keras_dist.train._checkpoint import write_checkpoint

_log = logging.getLogger("keras_dist.train")


class CheckpointManager:
    """Keeps the last ``max_to_keep`` checkpoints of a ``Checkpoint`` in ``directory``.

    ``tf.train.CheckpointManager``'s counterpart. ``max_to_keep=None`` keeps
    every checkpoint. With ``checkpoint_interval``, ``save`` writes only when
    ``step_counter`` (a variable) has moved on by that many steps since the
    last save. ``init_fn`` is called by ``restore_or_initialize`` when there is
    nothing to restore.

    >>> import tempfile, keras, keras_dist as kd
    >>> checkpoint = kd.train.Checkpoint(v=keras.Variable(1.0))
    >>> manager = kd.train.CheckpointManager(checkpoint, tempfile.mkdtemp(), max_to_keep=2)
    >>> for _ in range(3):
    ...     _ = manager.save()
    >>> [os.path.basename(p) for p in manager.checkpoints]
    ['ckpt-2', 'ckpt-3']
    >>> manager.latest_checkpoint == manager.checkpoints[-1]
    True
    """

    def __init__(
        self,
        checkpoint: Checkpoint,
        directory,
        max_to_keep,
        keep_checkpoint_every_n_hours=None,
        checkpoint_name: str = "ckpt",
        step_counter=None,
        checkpoint_interval=None,
        init_fn=None,
    ):
        if not isinstance(checkpoint, Checkpoint):
            raise TypeError(
                "`CheckpointManager` manages a `kd.train.Checkpoint`. "
                f"Received: checkpoint={type(checkpoint).__name__}"
            )
        if max_to_keep is not None and max_to_keep <= 0:
            raise ValueError(
                "`max_to_keep` must be a positive number of checkpoints, or None to keep "
                f"them all. Received: max_to_keep={max_to_keep}"
            )
        if checkpoint_interval is not None and step_counter is None:
            raise ValueError(
                "`step_counter` should be passed if `checkpoint_interval` is not None."
            )
        self._checkpoint = checkpoint
        self._directory = os.fspath(directory)
        self._max_to_keep = max_to_keep
        self._keep_checkpoint_every_n_hours = keep_checkpoint_every_n_hours
        self._prefix = os.path.join(self._directory, checkpoint_name)
        self._checkpoint_name = checkpoint_name
        self._step_counter = step_counter
        self._checkpoint_interval = checkpoint_interval
        self._init_fn = init_fn
        self._last_checkpoint_step = None
        self._maybe_delete = collections.OrderedDict()
        self._recover()

    def _recover(self) -> None:
        now = time.time()
        state = _state.read_state(self._directory)
        if state is None:
            self._latest_checkpoint = None
            self._last_preserved_timestamp = now
            return
        self._latest_checkpoint = state["model_checkpoint_path"]
        preserved = state.get("last_preserved_timestamp")
        self._last_preserved_timestamp = min(now, preserved if preserved is not None else now)
        paths = state["all_model_checkpoint_paths"]
        timestamps = state.get("all_model_checkpoint_timestamps") or []
        if len(timestamps) != len(paths):
            timestamps = [self._last_preserved_timestamp] * len(paths)
        for path, timestamp in zip(paths, timestamps):
            timestamp = min(timestamp, now)
            if timestamp > self._last_preserved_timestamp:
                self._maybe_delete[path] = timestamp

    @property
    def directory(self) -> str:
        """The directory the checkpoints are in."""
        return self._directory

    @property
    def checkpoint(self) -> Checkpoint:
        """The ``Checkpoint`` this manager saves and restores."""
        return self._checkpoint

    @property
    def checkpoint_interval(self):
        """The number of steps between checkpoints (``None``: every ``save`` writes)."""
        return self._checkpoint_interval

    @property
    def latest_checkpoint(self) -> "str | None":
        """The path of the newest checkpoint, or ``None`` before the first."""
        return self._latest_checkpoint

    @property
    def checkpoints(self) -> list:
        """The paths of the checkpoints kept (and not preserved), oldest first."""
        return list(self._maybe_delete)

    def _steps_since_last_save_are_enough(self, check_interval: bool) -> bool:
        if self._checkpoint_interval is None:
            return True
        step = _objects.as_int(self._step_counter)
        if self._last_checkpoint_step is not None:
            if step == self._last_checkpoint_step:
                return False
            if check_interval and step < self._last_checkpoint_step + self._checkpoint_interval:
                return False
        self._last_checkpoint_step = step
        return True

    def save(self, checkpoint_number=None, check_interval: bool = True, options=None):
        """Saves a checkpoint and deletes the oldest beyond ``max_to_keep``; returns its path.

        The number is ``checkpoint_number`` (an int or a variable such as a
        step counter) or else the checkpoint's ``save_counter``, which is
        incremented either way. Returns ``None`` when ``checkpoint_interval``
        says it is not time to save (``check_interval=False`` saves anyway,
        unless the step has not moved since the last save).

        >>> import tempfile, keras, keras_dist as kd
        >>> manager = kd.train.CheckpointManager(
        ...     kd.train.Checkpoint(v=keras.Variable(1.0)), tempfile.mkdtemp(), max_to_keep=1)
        >>> os.path.basename(manager.save(checkpoint_number=100))
        'ckpt-100'
        """
        if not self._steps_since_last_save_are_enough(check_interval):
            return None
        counter = self._checkpoint.save_counter
        counter.assign_add(1)
        if checkpoint_number is None:
            checkpoint_number = counter
        save_path = f"{self._prefix}-{_objects.as_int(checkpoint_number)}"
        writer = write_checkpoint(self._checkpoint, save_path)
        # An overwritten checkpoint goes to the end of the queue.
        self._maybe_delete.pop(save_path, None)
        self._maybe_delete[save_path] = time.time()
        self._latest_checkpoint = save_path
        if writer:
            # Recorded before deleting anything, and again after, so a preempted
            # sweep still leaves the new checkpoint named as the latest.
            self._record_state()
            self._sweep(delete_files=True)
            self._record_state()
            self._remove_leftovers()
        else:
            self._sweep(delete_files=False)
        wait_for_writer(self._checkpoint)
        return save_path

    def _record_state(self) -> None:
        _state.write_state(
            self._directory,
            self._latest_checkpoint,
            list(self._maybe_delete),
            list(self._maybe_delete.values()),
            self._last_preserved_timestamp,
        )

    def _sweep(self, delete_files: bool) -> None:
        if not self._max_to_keep:
            return
        while len(self._maybe_delete) > self._max_to_keep:
            path, timestamp = self._maybe_delete.popitem(last=False)
            hours = self._keep_checkpoint_every_n_hours
            if hours and timestamp - hours * 3600.0 >= self._last_preserved_timestamp:
                self._last_preserved_timestamp = timestamp
                continue
            if delete_files:
                _atomic_files.remove_tree(_format.file_of(path))

    def _remove_leftovers(self) -> None:
        # Temporary files of saves killed part-way: this manager is the only writer here.
        pattern = f"{_atomic_files.TEMPORARY_MARK}*-{self._checkpoint_name}-*{_format.SUFFIX}"
        for leftover in glob.glob(os.path.join(glob.escape(self._directory), pattern)):
            _atomic_files.remove_tree(leftover)

    def restore_or_initialize(self):
        """Restores the latest checkpoint, or calls ``init_fn`` when there is none.

        Returns the restored checkpoint's path, or ``None``. If the latest
        checkpoint cannot be decoded, the newest older one that can is restored
        (with a warning naming the damaged file); if none can, the error of the
        latest is raised.

        >>> import tempfile, keras, keras_dist as kd
        >>> manager = kd.train.CheckpointManager(
        ...     kd.train.Checkpoint(v=keras.Variable(1.0)), tempfile.mkdtemp(), max_to_keep=1,
        ...     init_fn=lambda: print("fresh start"))
        >>> manager.restore_or_initialize() is None
        fresh start
        True
        """
        if self._latest_checkpoint is None:
            if self._init_fn is not None:
                self._init_fn()
            return None
        candidates = [self._latest_checkpoint] + [
            p for p in reversed(self._maybe_delete) if p != self._latest_checkpoint
        ]
        first_error = None
        for path in candidates:
            try:
                self._checkpoint.restore(path)
            except (_format.CheckpointUnreadableError, FileNotFoundError) as error:
                first_error = first_error or error
                _log.warning("Skipping the checkpoint %r, which cannot be read: %s", path, error)
                continue
            if self._checkpoint_interval is not None:
                self._last_checkpoint_step = _objects.as_int(self._step_counter)
            return path
        raise first_error
