"""Keras callbacks for training under a strategy (``tf.keras.callbacks`` counterparts).

On several workers only the chief writes at the paths it is given; the others
do the same work into temporary directories that they delete, as in tf.keras.
"""

from keras_dist.callbacks._backup_and_restore import BackupAndRestore as BackupAndRestore
from keras_dist.callbacks._model_checkpoint import ModelCheckpoint as ModelCheckpoint
from keras_dist.callbacks._tensorboard import TensorBoard as TensorBoard

__all__ = [
    "BackupAndRestore",
    "ModelCheckpoint",
    "TensorBoard",
]
