"""Keras's own tests of ``fit`` and callbacks pass inside ``MirroredStrategy().scope()``.

Keras 3's tests of ``trainers/`` and ``callbacks/`` (from its source distribution, fetched
and cached by ``tests/keras_suite/keras_sources.py``) run with the scope around each whole
test, on 4 simulated devices. A test that passes without a strategy must pass with it,
unless it is on the reviewed list (``tests/keras_suite/known_differences.py``). The full
table (``optimizers/`` and ``models/`` too, and ``OneDeviceStrategy``) is
``python tests/keras_suite/run.py``.
"""

import pathlib
import subprocess
import sys

import pytest

RUNNER = pathlib.Path(__file__).resolve().parents[1] / "keras_suite" / "run.py"


@pytest.mark.timeout(1800)
def test_keras_trainer_and_callback_tests_pass_under_mirrored_strategy():
    command = [sys.executable, str(RUNNER), "--folders", "trainers", "callbacks"]
    result = subprocess.run(
        [*command, "--strategies", "mirrored"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=1700,
    )
    print(result.stdout)
    assert result.returncode == 0, result.stdout[-20000:]
    assert "mirrored" in result.stdout
