"""Keras's own test files for the installed Keras version, fetched once and cached.

Keras ships its tests in its source distribution only. They are not committed here: the
first run downloads ``keras==<installed version>`` with pip and keeps the test modules of the
folders asked for under ``$KERAS_DIST_SUITE_CACHE`` (default ``~/.cache/keras_dist``).

    python tests/keras_suite/keras_sources.py trainers callbacks   # prints the cache folder
"""

from __future__ import annotations

import os
import pathlib
import shutil
import subprocess
import sys
import tarfile
import tempfile
from importlib import metadata

SUITE_FOLDERS = ("trainers", "callbacks", "optimizers", "models")

# Keras's pytest settings (its pyproject.toml), so the tests run as Keras runs them: the
# warnings Keras turns into errors are errors here too.
_PYTEST_INI = """\
[pytest]
filterwarnings =
    error
    ignore::DeprecationWarning
    ignore::ImportWarning
    ignore::RuntimeWarning
    ignore::PendingDeprecationWarning
    ignore::FutureWarning
    ignore::UserWarning
    ignore:Custom mask layers require a config
markers =
    requires_trainable_backend: needs a backend that can train (every backend but numpy)
    stress: long-running
"""


# Keras's repository has a conftest.py that some test modules import a helper from; its
# source distribution does not ship it, so the cache gets this stand-in.
_CONFTEST = """\
import pytest
from keras.src.backend import backend


def skip_if_backend(given_backend, reason):
    return pytest.mark.skipif(backend() == given_backend, reason=reason)
"""


def keras_version() -> str:
    return metadata.version("keras")


def cache_root() -> pathlib.Path:
    default = pathlib.Path(os.environ.get("XDG_CACHE_HOME", pathlib.Path.home() / ".cache"))
    return pathlib.Path(os.environ.get("KERAS_DIST_SUITE_CACHE", default / "keras_dist"))


def test_sources(version: str | None = None) -> pathlib.Path:
    """The folder holding ``keras/src/<folder>/**/*_test.py`` of ``version``, fetched if needed.

    The folder keeps Keras's layout without its ``__init__.py`` files, so pytest imports each
    test module by path (``--import-mode=importlib``) and ``keras`` stays the installed one;
    the folder itself goes on ``PYTHONPATH`` for ``from conftest import skip_if_backend``.
    """
    version = version or keras_version()
    target = cache_root() / f"keras-{version}-tests"
    if (target / "pytest.ini").exists():
        return target
    with tempfile.TemporaryDirectory() as download:
        archive = _download_sdist(version, pathlib.Path(download))
        target.parent.mkdir(parents=True, exist_ok=True)
        staging = pathlib.Path(tempfile.mkdtemp(prefix=target.name, dir=target.parent))
        _extract_tests(archive, version, staging)
        (staging / "conftest.py").write_text(_CONFTEST)
        (staging / "pytest.ini").write_text(_PYTEST_INI)
        try:
            staging.rename(target)
        except OSError:  # another run cached it first
            shutil.rmtree(staging, ignore_errors=True)
    return target


def _download_sdist(version: str, into: pathlib.Path) -> pathlib.Path:
    command = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--quiet",
        "--no-deps",
        "--no-binary",
        ":all:",
        f"keras=={version}",
        "-d",
        str(into),
    ]
    for _ in range(3):  # a registry hiccup is not a failure of the suite
        result = subprocess.run(command, capture_output=True, text=True, timeout=600)
        archives = sorted(into.glob("keras-*.tar.gz"))
        if result.returncode == 0 and archives:
            return archives[0]
    raise RuntimeError(
        f"Could not download Keras {version}'s source distribution (it holds Keras's "
        f"tests). pip said:\n{result.stderr[-2000:]}"
    )


def _extract_tests(archive: pathlib.Path, version: str, into: pathlib.Path) -> None:
    prefix = f"keras-{version}/keras/src/"
    with tarfile.open(archive) as tar:
        for member in tar.getmembers():
            if not (member.isfile() and member.name.startswith(prefix)):
                continue
            relative = member.name[len(prefix) :]
            if relative.split("/")[0] in SUITE_FOLDERS and relative.endswith("_test.py"):
                destination = into / relative
                destination.parent.mkdir(parents=True, exist_ok=True)
                destination.write_bytes(tar.extractfile(member).read())


if __name__ == "__main__":
    print(test_sources())
