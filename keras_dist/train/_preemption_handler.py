"""``PreemptionCheckpointHandler``: save at a step boundary when the process is told to stop.

tf.distribute's handler for custom training loops, on ``kd.train``'s
checkpoints. Created, it restores the latest checkpoint of its directory (so a
restarted program resumes) and starts watching for a termination notice
(``_termination``). Each ``run(step_fn)`` first checks for a notice: when one
arrived, it records how many runs were done (``checkpointed_runs``, saved with
the checkpoint), saves, and calls ``exit_fn`` (``sys.exit(42)`` by default).

One process saves at the boundary where it first sees the notice. Several
processes must save at the same step: JAX's preemption sync manager picks it
(``multihost_utils.reached_preemption_sync_point``, asked at every run with the
run count, which every process keeps the same), as TF's handler agrees on a
step through its coordination service.
"""

import contextlib
import logging
import time
import weakref

import jax
import keras
from jax.experimental import multihost_utils

from keras_dist.train import _objects
from keras_dist.train import _termination
from keras_dist.train._checkpoint import Checkpoint
from keras_dist.train._manager import CheckpointManager

_log = logging.getLogger("keras_dist.train")

_RUNS_ATTRIBUTE = "checkpointed_runs"  # TF's name for the saved run count


class PreemptionCheckpointHandler:
    """Saves a checkpoint and exits when the process is about to be preempted.

    ``tf.distribute.experimental.PreemptionCheckpointHandler``'s counterpart.
    ``checkpoint_or_checkpoint_manager`` is a ``kd.train.Checkpoint`` (then
    ``checkpoint_dir`` is required, and a ``CheckpointManager`` keeping one
    checkpoint is made there) or a ``kd.train.CheckpointManager``. On creation
    the latest checkpoint is restored. Run each training step through
    ``run``; resume with ``total_run_calls``::

        handler = kd.experimental.PreemptionCheckpointHandler(
            strategy.cluster_resolver, checkpoint, checkpoint_dir)
        while handler.total_run_calls < steps:
            handler.run(distributed_train_step, next(iterator))

    Create it in the main thread (it installs a ``SIGTERM`` handler unless a
    ``termination_watcher_fn`` is configured) and call ``run`` in the
    cross-replica context.

    >>> import tempfile, keras, keras_dist as kd
    >>> checkpoint = kd.train.Checkpoint(v=keras.Variable(0.0))
    >>> handler = kd.experimental.PreemptionCheckpointHandler(
    ...     None, checkpoint, tempfile.mkdtemp(),
    ...     kd.experimental.TerminationConfig(termination_watcher_fn=lambda: False))
    >>> handler.run(lambda x: x + 1, 41)
    42
    >>> handler.total_run_calls
    1
    """

    def __init__(
        self,
        cluster_resolver,
        checkpoint_or_checkpoint_manager,
        checkpoint_dir=None,
        termination_config=None,
    ):
        target = checkpoint_or_checkpoint_manager
        if isinstance(target, Checkpoint):
            if not checkpoint_dir:
                raise ValueError(
                    "When a checkpoint is passed, a checkpoint_dir must be passed as well."
                )
            self._manager = CheckpointManager(target, checkpoint_dir, max_to_keep=1)
        elif isinstance(target, CheckpointManager):
            self._manager = target
        else:
            raise TypeError(
                "`checkpoint_or_checkpoint_manager` must be a `kd.train.Checkpoint` or "
                f"`kd.train.CheckpointManager`. Received: {type(target).__name__}"
            )
        if cluster_resolver is not None and "ps" in dict(cluster_resolver.cluster_spec().as_dict()):
            raise NotImplementedError(
                "PreemptionCheckpointHandler does not support usage with "
                "ParameterServerStrategy. Received: a cluster with 'ps' tasks"
            )
        self._cluster_resolver = cluster_resolver
        config = termination_config or _termination.TerminationConfig()
        self._watcher_fn = config.termination_watcher_fn
        self._exit_fn = config.exit_fn or _termination.default_exit
        self._grace_period = config.grace_period or 0
        self._save_fn = config.save_fn
        self._multi_process = jax.process_count() > 1

        checkpoint = self._manager.checkpoint
        if not hasattr(checkpoint, _RUNS_ATTRIBUTE):
            runs = keras.Variable(0, dtype="int32", trainable=False, name=_RUNS_ATTRIBUTE)
            setattr(checkpoint, _RUNS_ATTRIBUTE, runs)
        self._checkpointed_runs = getattr(checkpoint, _RUNS_ATTRIBUTE)
        self._manager.restore_or_initialize()
        self._run_counter = _objects.as_int(self._checkpointed_runs)

        self._estimated_run_time = 0.0
        self._runs_timed = 0
        self._final_countdown = False
        self._target_time = None
        self._notice = _termination.Notice()
        self._watch = None
        self._start_watching()

    def _start_watching(self) -> None:
        if self._multi_process:
            watch = _termination.NotifierWatch(self._watcher_fn)
        elif self._watcher_fn is not None:
            watch = _termination.PollingWatch(self._watcher_fn, self._notice.set)
        else:
            watch = _termination.SignalWatch(self._notice)
        self._watch = watch
        # Neither watch holds the handler: dropping it ends the thread and gives
        # SIGTERM back.
        self._finalizer = weakref.finalize(self, watch.close)

    def _stop_watching(self) -> None:
        self._finalizer()

    @property
    def total_run_calls(self) -> int:
        """How many times ``run`` was called, counting those before a restart.

        Restored from the checkpoint, so a resumed loop starts where it stopped.
        """
        return self._run_counter

    def run(self, distributed_train_function, *args, **kwargs):
        """Runs one training step; first saves and exits if termination was announced.

        Returns what ``distributed_train_function(*args, **kwargs)`` returns. Pass
        a function that trains one step (it calls ``strategy.run``), so the
        checkpoint is saved soon after the notice. Cross-replica context.
        """
        self._check_preemption_and_maybe_checkpoint()
        started = time.monotonic()
        result = distributed_train_function(*args, **kwargs)
        self._run_counter += 1
        self._runs_timed += 1
        elapsed = time.monotonic() - started
        self._estimated_run_time += (elapsed - self._estimated_run_time) / self._runs_timed
        return result

    def save_checkpoint_if_preempted(self, *args, **kwargs) -> None:
        """Saves and exits if termination was announced; for loops that do not use ``run``.

        Call it once per step, after the step. The arguments go to
        ``CheckpointManager.save`` (or to ``save_fn``).
        """
        self._check_preemption_and_maybe_checkpoint(*args, **kwargs)
        self._run_counter += 1

    @contextlib.contextmanager
    def watch_preemption_scope(self):
        """A scope for the training loop (TF's TPU API; a plain scope for these strategies).

        Errors of a lost peer already reach every process of a keras_dist job
        (``kd.errors.UnavailableError``), so nothing needs propagating here.

        >>> import tempfile, keras, keras_dist as kd
        >>> handler = kd.experimental.PreemptionCheckpointHandler(
        ...     None, kd.train.Checkpoint(v=keras.Variable(0.0)), tempfile.mkdtemp(),
        ...     kd.experimental.TerminationConfig(termination_watcher_fn=lambda: False))
        >>> with handler.watch_preemption_scope():
        ...     handler.run(lambda: "step")
        'step'
        """
        yield

    def _check_preemption_and_maybe_checkpoint(self, *args, **kwargs) -> None:
        if self._multi_process:
            # Every process asks at every step, with the same count: the sync
            # manager answers True on all of them at the same step.
            if multihost_utils.reached_preemption_sync_point(self._run_counter):
                self._save_checkpoint(*args, **kwargs)
                self._exit()
            return
        if not self._notice.is_set():
            return
        if self._grace_period > 0:
            if not self._final_countdown:
                # Save now, train on during the grace period, save again before it ends.
                self._save_checkpoint(*args, **kwargs)
                self._final_countdown = True
                # TF's margin: three times the time of two steps.
                margin = 3 * 2 * self._estimated_run_time
                self._target_time = self._notice.received_at + self._grace_period - margin
                _log.info("Checkpoint saved; training on for the grace period.")
                return
            if time.time() < self._target_time:
                return
        self._save_checkpoint(*args, **kwargs)
        self._exit()

    def _save_checkpoint(self, *args, **kwargs) -> None:
        self._checkpointed_runs.assign(self._run_counter)
        started = time.monotonic()
        if self._save_fn is not None:
            self._save_fn(*args, **kwargs)
        else:
            # A preemption save must not be skipped by the manager's interval.
            kwargs.setdefault("check_interval", False)
            self._manager.save(*args, **kwargs)
        _log.info(
            "PreemptionCheckpointHandler: checkpoint saved in %r at run %d (%.2f s).",
            self._manager.directory,
            self._run_counter,
            time.monotonic() - started,
        )

    def _exit(self) -> None:
        self._stop_watching()
        _log.info("PreemptionCheckpointHandler: checkpoint saved. Exiting.")
        self._exit_fn()
        # ``exit_fn`` returned (an in-process restart): training goes on unwatched, as
        # in TF; a new handler watches again.
        self._notice = _termination.Notice()
        self._final_countdown = False
