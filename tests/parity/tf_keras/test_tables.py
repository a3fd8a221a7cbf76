"""The two reviewed tables name what they should, each with a one-line reason."""

import pathlib
import re

from .known_failures import KNOWN_FAILURES
from .not_applicable import NOT_APPLICABLE

HERE = pathlib.Path(__file__).resolve().parent


def test_not_applicable_names_tf_keras_tests_with_a_reason():
    assert NOT_APPLICABLE
    for key, reason in NOT_APPLICABLE.items():
        assert re.fullmatch(r"\w+_test\.py::\S+", key), key
        assert reason.strip() and "\n" not in reason, key


def test_known_failures_name_ported_tests_with_a_reason():
    for key, reason in KNOWN_FAILURES.items():
        file, _, test = key.partition("::")
        path = HERE / file
        assert path.is_file(), key
        name = re.match(r"[\w*]+", test).group(0)
        if "*" not in name:
            assert f"def {name}(" in path.read_text(), key
        assert reason.strip() and "\n" not in reason, key
