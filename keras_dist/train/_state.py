"""The ``checkpoint`` file of a directory: which checkpoint is the latest (TF's CheckpointState).

TF keeps, beside the checkpoints, a file named ``checkpoint`` with the latest
checkpoint's path and the ones a ``CheckpointManager`` keeps. Here it holds the
same fields as JSON, with paths relative to the directory. It is replaced
atomically, and only after the checkpoint it names is complete, so it always
names a whole checkpoint.

>>> import tempfile
>>> directory = tempfile.mkdtemp()
>>> paths = [os.path.join(directory, "ckpt-1"), os.path.join(directory, "ckpt-2")]
>>> write_state(directory, paths[-1], paths, [1.0, 2.0], 0.0)
>>> read_state(directory)["all_model_checkpoint_paths"] == paths
True
>>> _atomic_files.read_json(os.path.join(directory, STATE_FILE))["model_checkpoint_path"]
'ckpt-2'
"""

import json
import logging
import os

from keras_dist import _atomic_files
from keras_dist.train import _format

STATE_FILE = "checkpoint"

_log = logging.getLogger("keras_dist.train")


def _relative(directory: str, path: str) -> str:
    if os.path.dirname(os.path.abspath(path)) == os.path.abspath(directory):
        return os.path.basename(path)
    return os.path.abspath(path)


def _absolute(directory: str, path: str) -> str:
    return path if os.path.isabs(path) else os.path.join(directory, path)


def write_state(directory, latest, all_paths, timestamps=None, last_preserved=None) -> None:
    """Records ``latest`` and ``all_paths`` (oldest first) in ``directory/checkpoint``."""
    state = {
        "model_checkpoint_path": _relative(directory, latest),
        "all_model_checkpoint_paths": [_relative(directory, p) for p in all_paths],
        "all_model_checkpoint_timestamps": list(timestamps or []),
        "last_preserved_timestamp": last_preserved,
    }
    os.makedirs(directory, exist_ok=True)
    _atomic_files.write_json(os.path.join(directory, STATE_FILE), state)


def read_state(directory, latest_filename=None) -> "dict | None":
    """The state of ``directory`` (paths joined to it), or ``None`` when it has none.

    Raises ``CheckpointUnreadableError`` naming the file when it cannot be decoded.
    """
    path = os.path.join(os.fspath(directory), latest_filename or STATE_FILE)
    if not os.path.isfile(path):
        return None
    try:
        state = _atomic_files.read_json(path)
        state["model_checkpoint_path"] = _absolute(directory, state["model_checkpoint_path"])
        state["all_model_checkpoint_paths"] = [
            _absolute(directory, p) for p in state["all_model_checkpoint_paths"]
        ]
    except (OSError, ValueError, KeyError, TypeError, json.JSONDecodeError) as error:
        raise _format.CheckpointUnreadableError(
            f"The checkpoint state file {path!r} cannot be read ({type(error).__name__}: "
            f"{error}). Delete it to let `CheckpointManager` start a new list of "
            f"checkpoints. Received: checkpoint_dir={os.fspath(directory)!r}"
        ) from error
    return state


def latest_checkpoint(checkpoint_dir, latest_filename=None) -> "str | None":
    """The path of the latest checkpoint saved in ``checkpoint_dir``, or ``None``.

    ``tf.train.latest_checkpoint``'s counterpart: pass the result to
    ``Checkpoint.restore``. The latest is the one ``Checkpoint.save`` or a
    ``CheckpointManager`` recorded last.

    >>> import os, tempfile, keras, keras_dist as kd
    >>> directory = tempfile.mkdtemp()
    >>> kd.train.latest_checkpoint(directory) is None
    True
    >>> path = kd.train.Checkpoint(v=keras.Variable(1.0)).save(os.path.join(directory, "ckpt"))
    >>> kd.train.latest_checkpoint(directory) == path
    True
    """
    state = read_state(checkpoint_dir, latest_filename)
    if state is None:
        return None
    path = state["model_checkpoint_path"]
    if _format.exists(path):
        return path
    _log.warning(
        "The checkpoint state in %r names %r, which has no file.",
        os.fspath(checkpoint_dir),
        path,
    )
    return None
