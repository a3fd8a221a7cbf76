"""Ported tf-keras tests that fail on a keras_dist bug: ``"file::test[id]"`` -> the bug.

``conftest.py`` runs each as ``xfail(strict=True)``: when the bug is fixed, the test
passes, strict xfail reports it as a failure, and its line here is removed. A ``*``
in a key matches any characters (the other characters match themselves).
"""

KNOWN_FAILURES: dict = {}
