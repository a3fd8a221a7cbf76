"""The ``strategy`` fixture; marks ``KNOWN_FAILURES`` as strict xfails; the full run.

``python -m pytest tests/parity/tf_keras`` (or ``-m tf_keras_full``) runs every
parametrization; a run that names no path in this folder (the README's CI command)
skips those marked ``tf_keras_full``, to keep CI short.
"""

import pathlib
import re

import pytest

from . import _strategies
from .known_failures import KNOWN_FAILURES

HERE = pathlib.Path(__file__).resolve().parent
FULL = "tf_keras_full"


def pytest_configure(config):
    config.addinivalue_line(
        "markers", f"{FULL}: slow parametrizations of the tf-keras port, run by its own path"
    )


@pytest.fixture
def strategy(request):
    """A fresh strategy named by the test's parameter (``_strategies.STRATEGIES``)."""
    return _strategies.make(request.param)


def _runs_the_full_port(config) -> bool:
    if FULL in (config.option.markexpr or ""):
        return True
    for arg in config.args:
        path = (config.invocation_params.dir / arg.split("::")[0]).resolve()
        if path == HERE or HERE in path.parents:
            return True
    return False


def known_failure(key: str):
    """The reason of the ``KNOWN_FAILURES`` pattern that matches ``file::test[id]``."""
    for pattern, reason in KNOWN_FAILURES.items():
        if re.fullmatch(".*".join(map(re.escape, pattern.split("*"))), key):
            return reason
    return None


def pytest_collection_modifyitems(config, items):
    full = _runs_the_full_port(config)
    skip_full = pytest.mark.skip(
        reason="part of the full tf-keras port: python -m pytest tests/parity/tf_keras"
    )
    for item in items:
        path = pathlib.Path(str(item.fspath)).resolve()
        if path.parent != HERE:
            continue
        reason = known_failure(f"{path.name}::{item.name}")
        if reason is not None:
            item.add_marker(pytest.mark.xfail(strict=True, reason=f"keras_dist: {reason}"))
        if not full and item.get_closest_marker(FULL):
            item.add_marker(skip_full)
