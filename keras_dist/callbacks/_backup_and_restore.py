"""``BackupAndRestore``: resume an interrupted ``fit`` where it stopped, on every worker.

tf.keras's layout and roles: the chief keeps the backup in
``<backup_dir>/chief/``; other workers save too (saving reads variables, which
may take a collective) but into ``<backup_dir>/workertemp_<task_id>/``, removed
right after (or, if the worker was killed, by its next process; by the chief
if the job restarts without it). Every worker restores from the chief's
backup, so all resume from the same state.

Resuming is exact: the backup holds the weights, the optimizer's slots and
iteration counter, the non-trainable and metric variables and NumPy's random
state (``_training_state``). An epoch interrupted mid-way resumes at its next
batch: Keras 3.15's loop always starts epochs at batch 0, so the batches
already trained are read from the data (keeping the shuffle order) but not
trained on. Callbacks still see their batch numbers, with the logs of the
backup, so step-counting callbacks stay in step with an uninterrupted run.
"""

import contextlib
import os

import jax
import keras
import numpy as np
from jax.experimental import multihost_utils

from keras_dist import _context
from keras_dist._capabilities import MeshRuntime
from keras_dist._keras import HoldsResources
from keras_dist._keras import fit_callbacks
from keras_dist._keras import set_initial_epoch
from keras_dist._keras_steps import model_strategy
from keras_dist.callbacks import _monitor_state
from keras_dist.callbacks import _preemption
from keras_dist.callbacks import _training_state
from keras_dist.callbacks import _writer_role


class _SkipTrainedBatches:
    """Stands in for ``model.train_function`` while the resumed epoch skips trained batches.

    Each call reads what one training call would (``steps_per_execution``
    batches) and trains on none; after the last skipped batch it puts the
    model's own function back.
    """

    def __init__(self, model, batches, logs):
        self.original = model.train_function
        self._model = model
        self._remaining = batches
        self._logs = logs
        model.train_function = self

    def __call__(self, state, iterator):
        next(iterator)  # running out here ends the epoch, as in Keras's own function
        skipped = 1
        try:
            while skipped < min(self._model.steps_per_execution, self._remaining):
                next(iterator)
                skipped += 1
        except StopIteration:
            pass
        self._remaining -= skipped
        if self._remaining <= 0:
            self.detach()
        return dict(self._logs), state

    def detach(self):
        if self._model.train_function is self:
            self._model.train_function = self.original

    @classmethod
    def remove_from(cls, model):
        """Puts the model's own function back after a ``fit`` that failed while skipping."""
        function = getattr(model, "train_function", None)
        if isinstance(function, cls):
            function.detach()


class BackupAndRestore(keras.callbacks.BackupAndRestore, HoldsResources):
    """Backs up the training state so that an interrupted ``fit`` resumes where it stopped.

    ``tf.keras.callbacks.BackupAndRestore`` for keras_dist: on several workers
    the chief writes the backup to ``<backup_dir>/chief/`` and the others write
    to a temporary directory that they delete; every worker restores from the
    chief's backup. A new ``fit`` with the same ``backup_dir`` (after a crash or
    a restart) resumes at the epoch and batch of the last backup, and ends with
    the weights an uninterrupted run would have. Once ``fit`` completes, the
    backup is deleted (unless ``delete_checkpoint=False``).

    The backup (``latest.weights.h5``, ``training_state.npz``,
    ``training_metadata.json``) holds what ``model.save_weights`` keeps (the
    weights, the optimizer's slots and iteration counter) plus the
    non-trainable and metric variables and NumPy's random state (Keras
    shuffles arrays with it). Use it in ``model.fit`` only, with the same
    model, ``compile`` arguments and data as the interrupted run. Resuming is
    exact when Keras reads the data again each epoch (arrays, finite datasets);
    an iterator carried across epochs (``steps_per_epoch`` shorter than the
    data) starts again at its beginning, as in tf.keras.

    Args:
        backup_dir: directory of the backup (shared by all workers). Do not
            use it for anything else.
        save_freq: ``"epoch"`` (at each epoch end), an integer ``n`` (every
            ``n`` batches), or ``False`` (only before a preemption).
        delete_checkpoint: delete the backup when ``fit`` completes.
        save_before_preemption: on ``SIGTERM``, all workers save at the same
            batch end and the process exits with code
            ``BackupAndRestore.PREEMPTION_EXIT_CODE`` (42, as tf.distribute's
            ``PreemptionCheckpointHandler`` outside Google Cloud), so that a
            supervisor restarts it and ``fit`` resumes. One process installs a
            ``SIGTERM`` handler during ``fit`` only (``fit`` must run in the
            main thread); several processes use JAX's preemption service.
        double_checkpoint: keep the previous backup too, used if the last one
            cannot be read (Keras 3's option; keyword only).

    >>> import tempfile, keras, numpy as np
    >>> import keras_dist as kd
    >>> from keras_dist.callbacks import BackupAndRestore
    >>> class Interrupt(keras.callbacks.Callback):
    ...     def on_epoch_end(self, epoch, logs=None):
    ...         if epoch == 1:
    ...             raise RuntimeError("interrupted")
    >>> backup = BackupAndRestore(tempfile.mkdtemp())
    >>> with kd.MirroredStrategy(["/cpu:0"]).scope():
    ...     model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    ...     model.compile("sgd", "mse")
    >>> x, y = np.ones((8, 2)), np.ones((8, 1))
    >>> try:
    ...     model.fit(x, y, epochs=4, callbacks=[backup, Interrupt()], verbose=0)
    ... except RuntimeError:
    ...     pass
    >>> history = model.fit(x, y, epochs=4, callbacks=[backup], verbose=0)
    >>> history.epoch  # epochs 0 and 1 were backed up: only 2 and 3 run again
    [2, 3]
    >>> int(model.optimizer.iterations)
    4
    """

    PREEMPTION_EXIT_CODE = _preemption.PREEMPTION_EXIT_CODE

    def __init__(
        self,
        backup_dir,
        save_freq="epoch",
        delete_checkpoint=True,
        save_before_preemption=False,
        *,
        double_checkpoint=False,
    ):
        if save_freq is False and not save_before_preemption:
            raise ValueError(
                "`save_freq=False` saves only before a preemption: also pass "
                f"`save_before_preemption=True`. Received: save_freq={save_freq!r}, "
                f"save_before_preemption={save_before_preemption!r}"
            )
        super().__init__(
            backup_dir,
            save_freq="epoch" if save_freq is False else save_freq,
            double_checkpoint=double_checkpoint,
            delete_checkpoint=delete_checkpoint,
        )
        self.save_freq = save_freq
        self.save_before_preemption = save_before_preemption
        self._chief_dir = os.path.join(str(backup_dir), "chief")
        self._process_role = None
        self._watcher = None
        self._resume = None
        self._skipper = None
        self._skip_until = 0
        self._epoch = 0
        self._last_batch = -1
        self._batches_since_save = 0
        self._epoch_rng_state = None

    # ------------------------------------------------------------- restoring
    def on_train_begin(self, logs=None):
        if self._watcher is not None:
            # Left installed by a fit that failed (Keras then calls no callback).
            watcher, self._watcher = self._watcher, None
            watcher.finish()
        model = self.model
        self._process_role = _writer_role.process_role(model)
        # What a killed worker left: its own next process, or the chief for a
        # task this job no longer has, removes it.
        self._process_role.remove_temp_dirpath(self.backup_dir)
        self._process_role.remove_orphaned_temp_dirs(self.backup_dir)
        _SkipTrainedBatches.remove_from(model)
        self._resume = None
        self._batches_since_save = 0
        set_initial_epoch(model, None)
        restored = _training_state.load(
            model, self._chief_dir, double_checkpoint=self.double_checkpoint
        )
        _check_same_resume_point(model, restored)
        if restored is not None:
            set_initial_epoch(model, restored.epoch)
            epoch_logs = restored.logs if restored.batch == 0 else None
            _monitor_state.restore(
                fit_callbacks(model), restored.callback_states, epoch_logs, restored.batch
            )
            self._batches_since_save = restored.batches_since_save
            if restored.batch > 0:
                self._resume = restored
        if self.save_before_preemption:
            self._watcher = _preemption.PreemptionWatcher()
            self._watcher.start()

    def on_epoch_begin(self, epoch, logs=None):
        self._epoch = epoch
        self._last_batch = -1
        # Keras draws the epoch's shuffle when its first batch is read: a
        # backup taken during this epoch restores the state from before.
        self._epoch_rng_state = np.random.get_state()
        resume, self._resume = self._resume, None
        if resume is not None and resume.epoch == epoch:
            _training_state.restore_metrics(self.model, resume.metrics, self._chief_dir)
            self._skipper = _SkipTrainedBatches(self.model, resume.batch, resume.logs)
            self._skip_until = resume.batch

    # ---------------------------------------------------------------- saving
    def on_train_batch_end(self, batch, logs=None):
        preempted = self._watcher is not None and self._watcher.reached_sync_point()
        if self._skipper is not None:
            if batch < self._skip_until:
                # Trained before the interruption: the backup on disk is this state.
                self._last_batch = batch
                if preempted:
                    self._watcher.exit()
                return
            self._skipper = None
        self._batches_since_save += batch - self._last_batch
        self._last_batch = batch
        scheduled = self.save_freq not in ("epoch", False)
        scheduled = scheduled and self._batches_since_save >= self.save_freq
        if scheduled:
            self._batches_since_save = 0
        if scheduled or preempted:
            self._save(self._epoch, batch + 1, logs, self._epoch_rng_state, batch_index=batch)
        if preempted:
            self._watcher.exit()

    def on_epoch_end(self, epoch, logs=None):
        if self._skipper is not None:
            self._skipper.detach()
            self._skipper = None
        if self.save_freq == "epoch":
            self._save(epoch + 1, 0, logs, np.random.get_state())

    def _save(self, epoch, batch, logs, rng_state, batch_index=None):
        """Every process saves: the chief into ``chief/``, the others into a temp dir.

        ``batch_index``: the batch at whose end the backup is taken (``None`` at an epoch end).
        """
        role = self._process_role
        dirpath = self._chief_dir if role.is_chief else role.write_dirpath(self.backup_dir)
        try:
            _training_state.save(
                self.model,
                dirpath,
                epoch=epoch,
                batch=batch,
                batches_since_save=self._batches_since_save,
                logs=logs,
                rng_state=rng_state,
                double_checkpoint=self.double_checkpoint,
                callback_states=_monitor_state.states(
                    fit_callbacks(self.model), taker=self, batch=batch_index, logs=logs
                ),
            )
        finally:
            role.remove_temp_dirpath(self.backup_dir)

    def on_train_end(self, logs=None):
        model = self.model
        _SkipTrainedBatches.remove_from(model)
        self._skipper = None
        set_initial_epoch(model, None)
        if self.delete_checkpoint:
            # Nobody may still be reading the backup when the chief deletes it.
            _extended_of(model).barrier("keras_dist.BackupAndRestore.delete")
            if self._process_role.is_chief:
                _training_state.delete(self._chief_dir)
            _extended_of(model).barrier("keras_dist.BackupAndRestore.deleted")
        self._process_role.remove_temp_dirpath(self.backup_dir)
        if self.delete_checkpoint:
            # As Keras, no backup directory is left behind; each process tries, after
            # its own copy is gone, and the last one finds it empty.
            with contextlib.suppress(OSError):
                os.rmdir(self.backup_dir)
        if self._watcher is not None:
            watcher, self._watcher = self._watcher, None
            watcher.finish()

    def release_resources(self):
        """After a ``fit`` that raised: the backup stays, the rest is put back.

        The model's own train function, the ``fit`` start epoch, the previous
        ``SIGTERM`` handler; a non-chief's temp dir is removed.
        """
        self._skipper = None
        if self.model is not None:
            _SkipTrainedBatches.remove_from(self.model)
            set_initial_epoch(self.model, None)
        if self._process_role is not None:
            self._process_role.remove_temp_dirpath(self.backup_dir)
        if self._watcher is not None:
            watcher, self._watcher = self._watcher, None
            watcher.finish()


def _multi_process_extended(model):
    """The model's multi-process mesh strategy's extended API, or None."""
    strategy = model_strategy(model)
    extended = None if strategy is None else strategy.extended
    return extended if isinstance(extended, MeshRuntime) and extended.spans_processes else None


def _check_same_resume_point(model, restored):
    """Fails, instead of training from different states, when workers read different backups."""
    if jax.process_count() == 1:
        return
    point = np.asarray((-1, -1) if restored is None else (restored.epoch, restored.batch), np.int32)
    extended = _multi_process_extended(model)
    if extended is None:  # jax.distributed started by hand, without our strategy
        points = np.asarray(multihost_utils.process_allgather(point))
    else:
        # Through the strategy: a lost peer is then reported by name, not waited on.
        rows = np.zeros((extended.num_workers, 2), np.int32)
        rows[extended.worker_index] = point
        points = np.asarray(extended.placement.cross_process_sum(rows))
    if not (points == points[0]).all():
        raise RuntimeError(
            "The workers found different backups in `backup_dir`: every worker must "
            "read the chief's backup, so `backup_dir` must be on a file system they all "
            f"share. Received: (epoch, batch) per process={points.tolist()}"
        )


def _extended_of(model):
    """The extended API of the model's strategy, or of the current one."""
    strategy = model_strategy(model)
    return (strategy if strategy is not None else _context.get_strategy()).extended
