"""The checkpoint file: one ZIP of ``.npy`` arrays and a JSON index, replaced atomically.

A checkpoint written at ``<prefix>`` is the single file ``<prefix>.npz``
(TF writes ``<prefix>.index`` and ``<prefix>.data-*``; one file here, so that
one ``os.replace`` makes it appear whole). Each value is a member
``<key>.npy``, so ``np.load(path)["model/0"]`` reads one back; the member
``keras_dist_checkpoint.json`` lists every key with the variable's path, shape
and dtype. The file is written under a temporary name, fsynced and renamed
(``_atomic_files``): a process killed at any moment leaves the previous file or
the new one, never a part. ZIP checks a CRC-32 per member when it is read, so
a damaged file raises ``CheckpointUnreadableError`` instead of giving wrong
numbers.

>>> import os, tempfile, numpy as np
>>> prefix = os.path.join(tempfile.mkdtemp(), "ckpt-1")
>>> write(prefix, {"v": np.arange(3.0)}, {"v": "v"})
>>> values, paths = read(prefix)
>>> values["v"]
array([0., 1., 2.])
"""

import io
import json
import os
import struct
import zipfile
import zlib

import ml_dtypes
import numpy as np

from keras_dist import _atomic_files

SUFFIX = ".npz"
INDEX = "keras_dist_checkpoint.json"
FORMAT = "keras_dist.train.Checkpoint"
VERSION = 1

# What a file that is not a whole checkpoint raises while it is decoded. A flipped
# bit in a ZIP header can name a compression method zipfile lacks
# (NotImplementedError), set the "encrypted" flag (RuntimeError), or give sizes
# and offsets that break zlib or struct.
_UNDECODABLE = (
    zipfile.BadZipFile,
    zipfile.LargeZipFile,
    json.JSONDecodeError,
    UnicodeDecodeError,
    KeyError,
    ValueError,
    TypeError,
    EOFError,
    OSError,
    NotImplementedError,
    RuntimeError,
    OverflowError,
    zlib.error,
    struct.error,
)


class CheckpointUnreadableError(ValueError):
    """A checkpoint file is there but cannot be decoded (damaged, cut short, or foreign).

    >>> issubclass(CheckpointUnreadableError, ValueError)
    True
    """


def file_of(save_path: str) -> str:
    """The file that holds the checkpoint ``save_path`` (a prefix, or the file itself).

    >>> file_of("/tmp/ckpt-3")
    '/tmp/ckpt-3.npz'
    """
    save_path = os.fspath(save_path)
    return save_path if save_path.endswith(SUFFIX) else save_path + SUFFIX


def exists(save_path: str) -> bool:
    """Whether the checkpoint ``save_path`` has a file."""
    return os.path.isfile(file_of(save_path))


def _storable(array: np.ndarray) -> np.ndarray:
    # ``.npy`` has no code for ml_dtypes' types (bfloat16, float8...): their bytes
    # are kept as unsigned integers and the index says what they are.
    if array.dtype.type.__module__.startswith("ml_dtypes"):
        return array.view(f"u{array.dtype.itemsize}")
    return array


def _dtype(name: str) -> np.dtype:
    extra = getattr(ml_dtypes, name, None)
    return np.dtype(extra) if extra is not None else np.dtype(name)


def write(save_path: str, values: dict, paths: dict) -> None:
    """Writes ``values`` (key -> NumPy array) as the checkpoint ``save_path``, atomically.

    ``paths`` names each key's variable, for error messages when reading.
    """
    target = file_of(save_path)
    directory = os.path.dirname(os.path.abspath(target))
    os.makedirs(directory, exist_ok=True)
    _atomic_files.remove_stale_temporaries(directory)  # left by a writer that was killed
    index = {"format": FORMAT, "version": VERSION, "values": {}}
    with _atomic_files.replaced_atomically(target) as temporary:
        with zipfile.ZipFile(temporary, "w", zipfile.ZIP_STORED, allowZip64=True) as archive:
            for key, value in values.items():
                array = np.asarray(value, order="C")  # keeps 0-d arrays 0-d
                index["values"][key] = {
                    "path": paths.get(key, key),
                    "shape": list(array.shape),
                    "dtype": str(array.dtype),
                }
                with archive.open(f"{key}.npy", "w", force_zip64=True) as member:
                    np.lib.format.write_array(member, _storable(array), allow_pickle=False)
            archive.writestr(INDEX, json.dumps(index, sort_keys=True))


def read(save_path: str) -> tuple:
    """The values of the checkpoint ``save_path`` (key -> NumPy array, all checked) and
    the paths of the variables they were saved from (key -> path).

    Raises ``FileNotFoundError`` when there is no such checkpoint and
    ``CheckpointUnreadableError`` when its file cannot be decoded; both name the path.
    """
    path = file_of(save_path)
    if not os.path.isfile(path):
        raise FileNotFoundError(
            f"There is no checkpoint at {save_path!r} (no file {path!r}). Pass a path "
            "returned by `Checkpoint.save`/`write` or `kd.train.latest_checkpoint`. "
            f"Received: save_path={save_path!r}"
        )
    try:
        return _decode(path)
    except PermissionError:
        raise  # readable by someone else: not a damaged file
    except _UNDECODABLE as error:
        raise CheckpointUnreadableError(
            f"The checkpoint {path!r} cannot be read: it is damaged or was not written by "
            f"keras_dist ({type(error).__name__}: {error}). Restore an earlier checkpoint "
            "(`CheckpointManager.checkpoints` lists them) or delete this one. "
            f"Received: save_path={save_path!r}"
        ) from error


def _decode(path: str) -> tuple:
    values, paths = {}, {}
    with zipfile.ZipFile(path) as archive:
        index = json.loads(archive.read(INDEX).decode())
        if index.get("format") != FORMAT or index.get("version") != VERSION:
            raise ValueError(f"unknown format {index.get('format')!r} {index.get('version')!r}")
        for key, entry in index["values"].items():
            # Reading a member whole checks its CRC-32.
            data = archive.read(f"{key}.npy")
            array = np.lib.format.read_array(io.BytesIO(data), allow_pickle=False)
            dtype = _dtype(entry["dtype"])
            if array.dtype != dtype:
                array = array.view(dtype)
            if list(array.shape) != entry["shape"]:
                raise ValueError(f"{key!r} has shape {array.shape}, its index {entry['shape']}")
            values[key] = array
            paths[key] = entry["path"]
    return values, paths
