"""Keras tests whose result under a strategy rightly differs from plain Keras.

Reviewed like code: every entry names the strategies it applies to and why the difference
is right (the test asserts something a strategy changes on purpose). A bug never goes here.
"""

KNOWN_DIFFERENCES: dict[str, tuple[tuple[str, ...], str]] = {}
