"""``ModelCheckpoint``: Keras's callback, writing at the user's path on the chief only.

Each file is written under a temporary name beside its destination and renamed
into place (``_atomic_files``): a process killed while saving leaves the
previous checkpoint, never half of a new one.
"""

import contextlib
import os

import keras

from keras_dist import _atomic_files
from keras_dist._keras import replaced_methods
from keras_dist.callbacks import _writer_role


class ModelCheckpoint(keras.callbacks.ModelCheckpoint):
    """Saves the model or its weights during ``fit``; on several workers, only the chief's stays.

    ``keras.callbacks.ModelCheckpoint`` (same arguments, ``.keras``, ``.h5``
    or ``.weights.h5``) with tf.keras's multi-worker behaviour: every worker
    saves, since saving reads variables, but only the chief at ``filepath``;
    the others save into ``<dir>/workertemp_<task_id>/``, deleted right after.
    In one process it is Keras's callback. Every file appears whole: it is
    written under a temporary name and renamed into place.

    >>> import os, tempfile, keras, numpy as np
    >>> from keras_dist.callbacks import ModelCheckpoint
    >>> path = os.path.join(tempfile.mkdtemp(), "model.weights.h5")
    >>> model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    >>> model.compile("sgd", "mse")
    >>> callback = ModelCheckpoint(path, save_weights_only=True)
    >>> _ = model.fit(np.ones((4, 2)), np.ones((4, 1)), callbacks=[callback], verbose=0)
    >>> os.path.exists(path)
    True
    """

    _save_role = None
    _write_filepath = None

    def _get_file_path(self, epoch, batch, logs):
        filepath = super()._get_file_path(epoch, batch, logs)
        self._write_filepath = self._save_role.write_filepath(filepath)
        # Keras creates the directory only if it is missing, without exist_ok: a
        # worker creating its temp dir inside it at the same moment would fail it.
        os.makedirs(os.path.dirname(self._write_filepath) or ".", exist_ok=True)
        return self._write_filepath

    def _save_model(self, epoch, batch, logs):
        self._save_role = _writer_role.process_role(self.model)
        self._write_filepath = None
        try:
            with _saving_atomically(self.model):
                super()._save_model(epoch, batch, logs)
        finally:
            if self._write_filepath is not None:
                self._save_role.remove_temp_dir_with_filepath(self._write_filepath)


@contextlib.contextmanager
def _saving_atomically(model):
    """``model.save`` and ``model.save_weights`` write a temporary file, then rename it."""

    def atomic(save):
        def write(filepath, *args, **kwargs):
            directory = os.path.dirname(os.path.abspath(str(filepath)))
            _atomic_files.remove_stale_temporaries(directory)  # left by a killed writer
            with _atomic_files.replaced_atomically(str(filepath)) as temporary:
                return save(temporary, *args, **kwargs)

        return write

    originals = {name: getattr(model, name) for name in ("save", "save_weights")}
    with replaced_methods(model, {name: atomic(save) for name, save in originals.items()}):
        yield
