"""``SidecarEvaluator`` and ``checkpoints_iterator``: evaluation beside a training job.

tf.keras's ``SidecarEvaluator`` (gone from Keras 3) runs in a process of its
own, often a parameter-server cluster's "evaluator" task: it waits for each new
checkpoint the training job writes, restores the model (and the optimizer, so
``optimizer.iterations`` says which training step it evaluates) and runs
``model.evaluate`` on its data. It reads what ``kd.train.Checkpoint`` /
``CheckpointManager`` save with ``model=`` and ``optimizer=`` (TF's names), or
the newest ``.weights.h5`` / ``.keras`` file ``ModelCheckpoint`` writes.
"""

import glob
import logging
import os
import re
import time

from keras_dist.train._checkpoint import Checkpoint
from keras_dist.train._format import CheckpointUnreadableError
from keras_dist.train._state import latest_checkpoint

_log = logging.getLogger("keras_dist")

_KERAS_FILES = ("*.weights.h5", "*.keras")


def checkpoints_iterator(checkpoint_dir, min_interval_secs=0, timeout=None, timeout_fn=None):
    """Yields each new latest checkpoint of ``checkpoint_dir`` as it appears.

    ``tf.train.checkpoints_iterator``'s counterpart: waits up to ``timeout``
    seconds (``None``: for ever) for the next one, then calls ``timeout_fn``
    (if given) and stops unless it returns false. The paths are those
    ``latest_checkpoint`` gives, or else the newest ``ModelCheckpoint`` file.

    >>> import tempfile
    >>> list(checkpoints_iterator(tempfile.mkdtemp(), timeout=0.1))
    []
    """
    last = None
    while True:
        path = _wait_for_new(checkpoint_dir, last, timeout)
        if path is None:
            if timeout_fn is None or timeout_fn():
                return
            continue
        started, last = time.monotonic(), path
        yield path
        time.sleep(max(0.0, min_interval_secs - (time.monotonic() - started)))


def _wait_for_new(checkpoint_dir, last, timeout):
    deadline = None if timeout is None else time.monotonic() + timeout
    while True:
        path = _newest(checkpoint_dir)
        if path is not None and path != last:
            return path
        if deadline is not None and time.monotonic() >= deadline:
            return None
        time.sleep(0.2 if timeout is None else min(0.2, max(0.0, deadline - time.monotonic())))


def _newest(checkpoint_dir):
    try:
        path = latest_checkpoint(checkpoint_dir)
    except CheckpointUnreadableError:  # (being written: the next look finds it whole)
        return None
    if path is not None:
        return path
    files = [
        p for pattern in _KERAS_FILES for p in glob.glob(os.path.join(checkpoint_dir, pattern))
    ]
    return max(files, key=os.path.getmtime) if files else None


class SidecarEvaluator:
    """Evaluates ``model`` on ``data`` at every new checkpoint in ``checkpoint_dir``.

    Args:
        model: a compiled Keras model of the training job's architecture.
        data: ``(x, y)`` or ``(x, y, sample_weight)`` arrays, or what ``model.evaluate``
            takes as ``x`` (a dataset of batches, a ``PyDataset``...).
        checkpoint_dir: where the training job saves its checkpoints.
        steps: batches per evaluation (``None``: all of ``data``).
        max_evaluations: stop after the checkpoint numbered this (``ckpt-N``, as
            ``CheckpointManager`` numbers them; TF's rule), or after this many
            evaluations of checkpoints without a number. ``None``: until ``timeout``.
        callbacks: passed to ``model.evaluate`` (e.g. ``kd.callbacks.TensorBoard``).
        timeout: seconds to wait for a new checkpoint before stopping (TF's 180).
        verbose: ``model.evaluate``'s (TF's evaluator prints one line: 2).

    ``results`` holds ``(iterations, logs)`` per evaluation: the optimizer's step
    count restored with the checkpoint (0 if it held no optimizer) and the metrics.

    >>> import os, tempfile, numpy as np, keras, keras_dist as kd
    >>> def make_model():
    ...     model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    ...     model.compile(optimizer="sgd", loss="mse")
    ...     return model
    >>> directory, trained = tempfile.mkdtemp(), make_model()
    >>> checkpoint = kd.train.Checkpoint(model=trained, optimizer=trained.optimizer)
    >>> _ = kd.train.CheckpointManager(checkpoint, directory, max_to_keep=2).save()
    >>> evaluator = kd.train.SidecarEvaluator(
    ...     make_model(), (np.ones((4, 2)), np.ones((4, 1))), directory,
    ...     max_evaluations=1, timeout=5, verbose=0)
    >>> evaluator.start()
    >>> [sorted(logs) for _, logs in evaluator.results]
    [['loss']]
    """

    def __init__(
        self,
        model,
        data,
        checkpoint_dir,
        steps=None,
        max_evaluations=None,
        callbacks=None,
        timeout=180,
        verbose=2,
    ):
        if not getattr(model, "compiled", False):
            raise ValueError(
                "SidecarEvaluator needs a compiled model (its loss and metrics are what it "
                "evaluates): call `model.compile(...)` first. Received: a model that was "
                "not compiled"
            )
        if max_evaluations is not None and max_evaluations < 1:
            raise ValueError(
                "`max_evaluations` must be a positive number or None. Received: "
                f"max_evaluations={max_evaluations!r}"
            )
        self.model = model
        self.data = data
        self.checkpoint_dir = os.fspath(checkpoint_dir)
        self.steps = steps
        self.max_evaluations = max_evaluations
        self.callbacks = callbacks
        self.timeout = timeout
        self.verbose = verbose
        self.results = []

    def start(self):
        """Evaluates checkpoint after checkpoint until ``max_evaluations`` or ``timeout``."""
        for path in checkpoints_iterator(self.checkpoint_dir, timeout=self.timeout):
            try:
                iterations = self._restore(path)
            except (CheckpointUnreadableError, OSError) as error:
                # A checkpoint deleted (max_to_keep) while read: the next one. (Another
                # model's checkpoint raises: it is the wrong directory, not a race.)
                _log.warning("SidecarEvaluator could not restore %s (%s); waiting.", path, error)
                continue
            _log.info(
                "Evaluation starts: model weights loaded from %s with iterations %s.",
                path,
                iterations,
            )
            # ``(x, y)`` or ``(x, y, sample_weight)`` arrays; else a dataset of batches.
            data = self.data if isinstance(self.data, tuple) else (self.data,)
            logs = self.model.evaluate(
                *data,
                steps=self.steps,
                callbacks=self.callbacks,
                verbose=self.verbose,
                return_dict=True,
            )
            self.results.append((iterations, logs))
            _log.info("End of evaluation. Metrics: %s", logs)
            if self._done(path):
                _log.info("Last checkpoint evaluated. SidecarEvaluator stops.")
                return

    def _restore(self, path):
        optimizer = self.model.optimizer
        if path.endswith(tuple(pattern[1:] for pattern in _KERAS_FILES)):
            if not optimizer.built:  # (so that its saved state, iterations included, loads)
                optimizer.build(self.model.trainable_variables)
            self.model.load_weights(path)
        else:
            Checkpoint(model=self.model, optimizer=optimizer).restore(path).expect_partial()
        return int(optimizer.iterations.numpy())

    def _done(self, path) -> bool:
        if self.max_evaluations is None:
            return False
        number = re.search(r"-(\d+)(\.weights\.h5|\.keras)?$", path)
        if number is not None:
            return int(number.group(1)) >= self.max_evaluations
        return len(self.results) >= self.max_evaluations
