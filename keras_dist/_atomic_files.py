"""Files that are either wholly written or not there: temporary name, fsync, rename.

A process killed at any moment (SIGKILL, a preempted machine) must never leave
a checkpoint half-written where a restart reads it. Everything keras_dist
saves is written under a temporary name in the destination's directory,
flushed and fsynced, then renamed into place; ``os.replace`` is atomic on one
file system, and the directory is fsynced so the rename survives a crash.

>>> import os, tempfile
>>> path = os.path.join(tempfile.mkdtemp(), "notes.json")
>>> write_json(path, {"epoch": 3})
>>> read_json(path)
{'epoch': 3}
"""

import contextlib
import hashlib
import json
import os
import shutil
import socket
import uuid

TEMPORARY_MARK = ".keras_dist-tmp-"
_HOST = socket.gethostname().replace(".", "_").replace("-", "_")


def fsync_file(path: str) -> None:
    """Flushes ``path``'s data to disk."""
    with open(path, "rb") as file:
        os.fsync(file.fileno())


def fsync_dir(path: str) -> None:
    """Makes renames and new entries in directory ``path`` durable."""
    try:
        descriptor = os.open(path, os.O_RDONLY)
    except OSError:
        return  # a platform without directory descriptors: nothing more to do
    try:
        os.fsync(descriptor)
    except OSError:
        pass  # some file systems refuse fsync on directories; the rename is still atomic
    finally:
        os.close(descriptor)


def temporary_sibling(path: str) -> str:
    """A fresh name beside ``path`` that keeps its ending (``.keras``, ``.weights.h5``).

    It names its writer (host and process id), so that what a killed writer
    left can be told from what a live one is writing (``remove_stale_temporaries``).
    """
    directory, name = os.path.split(os.path.abspath(path))
    writer = f"{_HOST}.{os.getpid()}"
    return os.path.join(directory, f"{TEMPORARY_MARK}{writer}.{uuid.uuid4().hex[:8]}-{name}")


def remove_stale_temporaries(directory: str) -> None:
    """Removes temporary files that writers on this host left when they were killed."""
    try:
        names = os.listdir(directory)
    except OSError:
        return
    for name in names:
        if not name.startswith(TEMPORARY_MARK):
            continue
        host, _, rest = name[len(TEMPORARY_MARK) :].partition(".")
        pid = rest.partition(".")[0]
        if host == _HOST and pid.isdigit() and not _alive(int(pid)):
            remove_tree(os.path.join(directory, name))


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


@contextlib.contextmanager
def replaced_atomically(path: str):
    """Yields a temporary path; once the body has written it, it replaces ``path``.

    If the body fails (or writes nothing), ``path`` is left as it was and the
    temporary file is removed.
    """
    temporary = temporary_sibling(path)
    try:
        yield temporary
        if os.path.exists(temporary):
            fsync_file(temporary)
            os.replace(temporary, path)
            fsync_dir(os.path.dirname(os.path.abspath(path)))
    finally:
        if os.path.exists(temporary):
            os.remove(temporary)


def write_bytes(path: str, data: bytes) -> None:
    """Writes ``data`` to ``path`` atomically."""
    with replaced_atomically(path) as temporary:
        with open(temporary, "wb") as file:
            file.write(data)


def write_json(path: str, value) -> None:
    """Writes ``value`` as JSON to ``path`` atomically."""
    write_bytes(path, json.dumps(value, sort_keys=True).encode())


def read_json(path: str):
    """Reads a JSON file."""
    with open(path, "rb") as file:
        return json.loads(file.read().decode())


def sha256(path: str) -> str:
    """The SHA-256 of a file's bytes, as hex."""
    digest = hashlib.sha256()
    with open(path, "rb") as file:
        for block in iter(lambda: file.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def remove_tree(path: str) -> None:
    """Removes a file or directory if it is there."""
    if os.path.isdir(path):
        shutil.rmtree(path, ignore_errors=True)
    elif os.path.exists(path):
        os.remove(path)
