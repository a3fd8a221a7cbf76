"""``ModelCheckpoint``: Keras's callback, writing at the user's path on the chief only."""

import os

import keras

from keras_dist.callbacks import _role


class ModelCheckpoint(keras.callbacks.ModelCheckpoint):
    """Saves the model or its weights during ``fit``; on several workers, only the chief's stays.

    ``keras.callbacks.ModelCheckpoint`` (same arguments, ``.keras``, ``.h5``
    or ``.weights.h5``) with tf.keras's multi-worker behaviour: every worker
    saves, since saving reads variables, but only the chief at ``filepath``;
    the others save into ``<dir>/workertemp_<task_id>/``, deleted right after.
    In one process it is Keras's callback.

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
        self._save_role = _role.process_role(self.model)
        self._write_filepath = None
        try:
            super()._save_model(epoch, batch, logs)
        finally:
            if self._write_filepath is not None:
                self._save_role.remove_temp_dir_with_filepath(self._write_filepath)
