"""Checkpoints for custom training loops (``tf.train`` counterparts).

``Checkpoint`` saves Keras models, optimizers, metrics and variables (those a
strategy created included) together; ``CheckpointManager`` keeps the last few
in a directory; ``latest_checkpoint`` finds the newest and
``checkpoints_iterator`` yields each new one; ``SidecarEvaluator`` evaluates
each new one beside the training job. Every file is written
atomically: a process killed while saving leaves the previous checkpoint as
the latest, never a broken one.

>>> import os, tempfile, keras, keras_dist as kd
>>> directory = tempfile.mkdtemp()
>>> manager = kd.train.CheckpointManager(
...     kd.train.Checkpoint(step=keras.Variable(3)), directory, max_to_keep=3)
>>> path = manager.save()
>>> kd.train.latest_checkpoint(directory) == path
True
"""

from keras_dist.train._checkpoint import Checkpoint as Checkpoint
from keras_dist.train._format import CheckpointUnreadableError as CheckpointUnreadableError
from keras_dist.train._manager import CheckpointManager as CheckpointManager
from keras_dist.train._sidecar_evaluator import SidecarEvaluator as SidecarEvaluator
from keras_dist.train._sidecar_evaluator import checkpoints_iterator as checkpoints_iterator
from keras_dist.train._state import latest_checkpoint as latest_checkpoint

__all__ = [
    "Checkpoint",
    "CheckpointManager",
    "CheckpointUnreadableError",
    "SidecarEvaluator",
    "checkpoints_iterator",
    "latest_checkpoint",
]
