"""``TensorBoard``: Keras's scalar and histogram logs, written without TensorFlow, by the chief.

Keras 3's ``keras.callbacks.TensorBoard`` writes through ``tf.summary``. This
one writes the same event files with ``tensorboardX``'s protos (``_summaries``): the same run
directories (``log_dir/train``, ``log_dir/validation``), tags (``epoch_loss``,
``batch_loss``, ``epoch_learning_rate``, ``evaluation_loss_vs_iterations``,
``<weight path>/histogram``, the model's config as ``keras``), steps and TF 2's
tensor summaries (``_summaries``).

On several workers only the chief writes (tf.keras: "TensorBoard writes only
on the chief"); the others compute the same values, so that a read which needs
a collective happens on every worker, and write nothing.
"""

import os
import time
import warnings

import keras
import numpy as np

from keras_dist._keras import HoldsResources
from keras_dist.callbacks import _writer_role
from keras_dist.callbacks._summaries import EventFile
from keras_dist.callbacks._summaries import histogram_summary
from keras_dist.callbacks._summaries import keras_model_summary
from keras_dist.callbacks._summaries import scalar_summary


class TensorBoard(keras.callbacks.Callback, HoldsResources):
    """Writes ``fit``'s logs (and optionally weight histograms) for TensorBoard.

    The arguments are ``keras.callbacks.TensorBoard``'s. Written: epoch-level
    train and validation scalars, the learning rate, batch-level scalars every
    ``update_freq`` batches (an integer, or ``"batch"`` for 1),
    ``evaluation_<metric>_vs_iterations`` after each evaluation, steps per
    second with ``write_steps_per_second``, weight histograms every
    ``histogram_freq`` epochs, and with ``write_graph`` a ``Sequential`` or
    functional model's config (TensorBoard's graph tab draws it). Not written:
    the traced train function's op graph (there is no TensorFlow graph), weight images,
    embeddings and profiles (use ``jax.profiler``), which warn when asked for.
    When ``fit``, ``evaluate`` or ``predict`` raises, the event files written so
    far are closed (complete and readable) and their writers' threads end.

    >>> import os, tempfile, keras, numpy as np
    >>> from keras_dist.callbacks import TensorBoard
    >>> log_dir = tempfile.mkdtemp()
    >>> model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    >>> model.compile("sgd", "mse")
    >>> x, y = np.ones((4, 2)), np.ones((4, 1))
    >>> _ = model.fit(x, y, validation_data=(x, y), callbacks=[TensorBoard(log_dir)], verbose=0)
    >>> sorted(os.listdir(log_dir))
    ['train', 'validation']
    """

    def __init__(
        self,
        log_dir="logs",
        histogram_freq=0,
        write_graph=True,
        write_images=False,
        write_steps_per_second=False,
        update_freq="epoch",
        profile_batch=0,
        embeddings_freq=0,
        embeddings_metadata=None,
    ):
        super().__init__()
        self.log_dir = os.fspath(log_dir)
        self.histogram_freq = histogram_freq
        self.write_graph = write_graph
        self.write_images = write_images
        self.write_steps_per_second = write_steps_per_second
        self.update_freq = 1 if update_freq == "batch" else update_freq
        if self.update_freq != "epoch" and not isinstance(self.update_freq, int):
            raise ValueError(
                "`update_freq` must be 'epoch', 'batch' or an integer. "
                f"Received: update_freq={update_freq!r}"
            )
        self.profile_batch = profile_batch
        self.embeddings_freq = embeddings_freq
        self.embeddings_metadata = embeddings_metadata
        unsupported = {
            "write_images": write_images,
            "profile_batch": profile_batch,
            "embeddings_freq": embeddings_freq,
        }
        for name, value in unsupported.items():
            if value:
                warnings.warn(
                    f"keras_dist.callbacks.TensorBoard does not write `{name}` "
                    f"(no TensorFlow); only scalars and histograms are written. "
                    f"Received: {name}={value!r}",
                    stacklevel=2,
                )
        self._writers = {}
        self._is_writer = True
        self._global_train_batch = 0
        self._batch_start_time = 0.0
        self._epoch_start_time = 0.0
        self._epoch_start_iterations = 0

    def set_model(self, model):
        super().set_model(model)
        self._close_writers()
        self._is_writer = _writer_role.process_role(model).is_chief
        if self.write_graph and type(model).__name__ in ("Functional", "Sequential"):
            summary = keras_model_summary("keras", model)
            writer = self._writer("train") if summary is not None else None
            if writer is not None:
                writer.add_summary(summary, global_step=0)

    # ---------------------------------------------------------------- writers
    def _writer(self, run):
        """The event writer of ``train`` or ``validation``; ``None`` off the chief."""
        if not self._is_writer:
            return None
        if run not in self._writers:
            self._writers[run] = EventFile(os.path.join(self.log_dir, run))
        return self._writers[run]

    def _scalars(self, run, values, step, prefix=""):
        values = {name: _scalar(value) for name, value in values.items()}
        values = {name: value for name, value in values.items() if value is not None}
        writer = self._writer(run) if values else None  # no empty run directories
        if writer is None:
            return
        for name, value in values.items():
            writer.add_summary(scalar_summary(f"{prefix}{name}", value), global_step=int(step))

    def _close_writers(self):
        for writer in self._writers.values():
            writer.close()
        self._writers = {}

    # -------------------------------------------------------------- callbacks
    def on_train_begin(self, logs=None):
        self._global_train_batch = 0

    def on_train_end(self, logs=None):
        self._close_writers()

    def release_resources(self):
        self._close_writers()

    def on_epoch_begin(self, epoch, logs=None):
        if self.write_steps_per_second:
            self._epoch_start_time = time.time()
            self._epoch_start_iterations = self._iterations()

    def on_train_batch_begin(self, batch, logs=None):
        self._global_train_batch += 1
        if self.write_steps_per_second:
            self._batch_start_time = time.time()

    def on_train_batch_end(self, batch, logs=None):
        if self.update_freq == "epoch" or self._global_train_batch % self.update_freq:
            return
        values = dict(logs) if isinstance(logs, dict) else {}
        if self.write_steps_per_second:
            elapsed = time.time() - self._batch_start_time
            values["steps_per_second"] = 1.0 / elapsed if elapsed > 0 else 0.0
        self._scalars("train", values, self._global_train_batch, prefix="batch_")

    def on_test_end(self, logs=None):
        optimizer = self.model.optimizer
        if optimizer is None or not hasattr(optimizer, "iterations") or not logs:
            return
        step = self._iterations()
        values = {f"evaluation_{name}_vs_iterations": value for name, value in logs.items()}
        self._scalars("validation", values, step)
        self._flush()

    def on_epoch_end(self, epoch, logs=None):
        logs = logs or {}
        train = {k: v for k, v in logs.items() if not k.startswith("val_")}
        validation = {k[len("val_") :]: v for k, v in logs.items() if k.startswith("val_")}
        train.update(self._learning_rates())
        if self.write_steps_per_second:
            elapsed = time.time() - self._epoch_start_time
            steps = self._iterations() - self._epoch_start_iterations
            train["steps_per_second"] = steps / elapsed if elapsed > 0 else 0.0
        self._scalars("train", train, epoch, prefix="epoch_")
        self._scalars("validation", validation, epoch, prefix="epoch_")
        if self.histogram_freq and epoch % self.histogram_freq == 0:
            self._histograms(epoch)
        self._flush()

    # ----------------------------------------------------------------- values
    def _iterations(self) -> int:
        return int(np.asarray(self.model.optimizer.iterations))

    def _learning_rates(self) -> dict:
        optimizer = self.model.optimizer
        optimizer = getattr(optimizer, "inner_optimizer", optimizer)
        if hasattr(optimizer, "optimizers"):
            return {
                f"learning_rate_{inner.name}": np.asarray(inner.learning_rate)
                for inner in optimizer.optimizers
            }
        if isinstance(optimizer, keras.optimizers.Optimizer):
            return {"learning_rate": np.asarray(optimizer.learning_rate)}
        return {}

    def _histograms(self, epoch):
        writer = self._writer("train")
        for layer in self.model.layers:
            for weight in layer.weights:
                values = np.asarray(weight)  # read on every worker, written by one
                if writer is not None:
                    name = weight.path.replace(":", "_")
                    writer.add_summary(histogram_summary(f"{name}/histogram", values), epoch)

    def _flush(self):
        for writer in self._writers.values():
            writer.flush()


def _scalar(value):
    """A log value as a float; ``None`` for values that are not scalars."""
    try:
        array = np.asarray(value)
    except (TypeError, ValueError):
        return None
    if array.ndim != 0 or not np.issubdtype(array.dtype, np.number):
        return None
    return float(array)
