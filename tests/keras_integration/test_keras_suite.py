"""Keras's own tests of ``fit`` and callbacks pass inside ``MirroredStrategy().scope()``.

Keras 3's tests of ``trainers/`` and ``callbacks/`` (from its source distribution, fetched
and cached by ``tests/keras_suite/keras_sources.py``) run with the scope around each whole
test, on 4 simulated devices. A test that passes without a strategy must pass with it,
unless it is on the reviewed list (``tests/keras_suite/known_differences.py``). The full
table (``optimizers/`` and ``models/`` too, and ``OneDeviceStrategy``) is
``python tests/keras_suite/run.py``. The pass starts in the background when the session's
tests are collected (``tests/conftest.py``); this test waits for it.
"""

import pytest


@pytest.mark.timeout(1800)
def test_keras_trainer_and_callback_tests_pass_under_mirrored_strategy(keras_suite_mirrored_pass):
    code, output = keras_suite_mirrored_pass.result(timeout=1700)
    print(output)
    assert code == 0, output[-20000:]
    assert "mirrored" in output
