"""What ``Checkpoint.restore`` returns: which values found an object, and which did not.

TF restores lazily and lets the status object tell afterwards whether the
checkpoint and the Python objects matched. Here every value is assigned when
``restore`` returns, and the status keeps the two lists TF's asserts look at:

* ``unused``: keys in the checkpoint that no object took,
* ``missing``: variables of the objects that the checkpoint has no value for.
"""

import logging

_log = logging.getLogger("keras_dist.train")


def _listing(items: dict) -> str:
    shown = [f"{key} ({path})" if path != key else key for key, path in items.items()]
    if len(shown) > 20:
        shown = shown[:20] + [f"... and {len(shown) - 20} more"]
    return ", ".join(shown)


class CheckpointLoadStatus:
    """The result of ``Checkpoint.restore``/``read`` of a checkpoint file.

    >>> import os, tempfile, keras, keras_dist as kd
    >>> path = kd.train.Checkpoint(v=keras.Variable(1.0)).write(
    ...     os.path.join(tempfile.mkdtemp(), "c"))
    >>> status = kd.train.Checkpoint(v=keras.Variable(0.0)).read(path)
    >>> status.assert_consumed() is status
    True
    """

    def __init__(self, save_path: str, restored: dict, unused: dict, missing: dict):
        self.save_path = save_path
        self._restored = dict(restored)
        self._unused = dict(unused)
        self._missing = dict(missing)
        self._quiet = False

    @property
    def unused_keys(self) -> list:
        """Keys in the checkpoint that no object took."""
        return sorted(self._unused)

    @property
    def missing_keys(self) -> list:
        """Keys of variables the objects have and the checkpoint does not."""
        return sorted(self._missing)

    def assert_consumed(self) -> "CheckpointLoadStatus":
        """Raises ``AssertionError`` unless the checkpoint and the objects matched exactly.

        Every value in the checkpoint must have found a variable, and every
        variable of the objects a value.
        """
        self._quiet = True
        if self._unused:
            raise AssertionError(
                f"Unresolved values in the checkpoint {self.save_path!r}: no object took "
                f"{_listing(self._unused)}. Add the objects they belong to to the "
                "`Checkpoint`, or call `expect_partial()` to restore part of a checkpoint."
            )
        self.assert_existing_objects_matched()
        return self

    def assert_existing_objects_matched(self) -> "CheckpointLoadStatus":
        """Raises ``AssertionError`` if a variable of the objects was not in the checkpoint.

        Values in the checkpoint that no object took are allowed.
        """
        self._quiet = True
        if self._missing:
            raise AssertionError(
                f"Some variables were not restored from {self.save_path!r}: the checkpoint "
                f"has no value for {_listing(self._missing)}. The checkpoint was written "
                "for other objects (or before these variables existed)."
            )
        return self

    def assert_nontrivial_match(self) -> "CheckpointLoadStatus":
        """Raises ``AssertionError`` unless at least one variable was restored."""
        self._quiet = True
        if not self._restored:
            raise AssertionError(
                f"Nothing was restored from {self.save_path!r}: no key of the checkpoint "
                "matches a variable of the objects."
            )
        return self

    def expect_partial(self) -> "CheckpointLoadStatus":
        """Silences the warning about checkpoint values that no object took."""
        self._quiet = True
        return self

    def run_restore_ops(self, session=None) -> None:
        """Nothing to run: values are restored when ``restore`` returns (TF1 API)."""

    def initialize_or_restore(self, session=None) -> None:
        """Nothing to do: values are restored when ``restore`` returns (TF1 API)."""

    def __del__(self):
        if self._unused and not self._quiet:
            _log.warning(
                "Values in the checkpoint %r were not restored: no object took %s. Call "
                "`expect_partial()` on the status if this is intended.",
                self.save_path,
                _listing(self._unused),
            )


class InitializationOnlyStatus:
    """The result of ``restore(None)``: nothing was restored (as in TF).

    >>> import keras_dist as kd
    >>> status = kd.train.Checkpoint().restore(None)
    >>> status.expect_partial() is status
    True
    """

    save_path = None

    def _nothing(self):
        raise AssertionError("No checkpoint specified (save_path=None); nothing is being restored.")

    def assert_consumed(self):
        """Raises ``AssertionError``: no checkpoint was given."""
        self._nothing()

    def assert_existing_objects_matched(self):
        """Raises ``AssertionError``: no checkpoint was given."""
        self._nothing()

    def assert_nontrivial_match(self):
        """Raises ``AssertionError``: no checkpoint was given."""
        self._nothing()

    def expect_partial(self) -> "InitializationOnlyStatus":
        """Returns the status itself."""
        return self

    def run_restore_ops(self, session=None) -> None:
        """Nothing to run."""

    def initialize_or_restore(self, session=None) -> None:
        """Nothing to do: variables keep the values they were created with."""
