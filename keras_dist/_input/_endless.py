"""Inputs that never end, refused where a loop would read them without its steps.

tf-keras refused a dataset of infinite cardinality (``.repeat()``) without the
number of steps to run, since an epoch would never end. A ``tf.data`` dataset
says so through ``cardinality()`` (``tf.data.INFINITE_CARDINALITY``, -1), read
here without importing TensorFlow; a Grain dataset repeated without end has
``len()`` ``sys.maxsize``. Other sources (a generator, a ``PyDataset`` without
a length, a ``tf.data`` dataset of unknown cardinality) cannot tell ahead: a
distributed dataset of one is read until it ends, with a warning that says so.

>>> import numpy as np
>>> length_of([np.zeros(2), np.zeros(2)]), length_of(iter([]))
(2, None)
"""

import sys
import warnings

# tf.data.INFINITE_CARDINALITY (UNKNOWN_CARDINALITY is -2).
_INFINITE_CARDINALITY = -1


def _is_tf_dataset(dataset) -> bool:
    module = type(dataset).__module__ or ""
    return module.startswith("tensorflow") and callable(getattr(dataset, "cardinality", None))


def is_endless(dataset) -> bool:
    """Whether ``dataset`` says it never ends (``.repeat()`` of ``tf.data`` or Grain)."""
    if _is_tf_dataset(dataset):
        return int(dataset.cardinality()) == _INFINITE_CARDINALITY
    try:
        return len(dataset) >= sys.maxsize
    except (TypeError, NotImplementedError):
        return False


def length_of(dataset) -> "int | None":
    """The number of elements ``dataset`` says it has, or ``None`` where it cannot tell."""
    if _is_tf_dataset(dataset):
        size = int(dataset.cardinality())
        return size if size >= 0 else None
    try:
        size = len(dataset)
    except (TypeError, NotImplementedError):
        return None
    return size if size < sys.maxsize else None


def refuse_endless(sources, received: str, steps_name: str, distributed: bool) -> None:
    """Raises when one of ``sources`` never ends; warns for a distributed dataset whose
    sources cannot tell their length.

    ``received`` names the argument (``"x"``), ``steps_name`` the loop's steps
    argument for it (``"steps_per_epoch"``).
    """
    fix = (
        f"pass `{steps_name}` (the number of batches to read), or `{steps_name}=-1` to read "
        "it without end"
    )
    for source in sources:
        if is_endless(source):
            kind = "a distributed dataset of " if distributed else ""
            raise ValueError(
                "When providing an infinite dataset, you must specify the number of steps "
                f"to run: {fix} (if you did not intend to create an infinite dataset, do "
                "not call `repeat()` on it). Received: "
                f"{received}={kind}{type(source).__name__} of infinite cardinality with "
                f"{steps_name}=None"
            )
    if distributed and any(length_of(source) is None for source in sources):
        warnings.warn(
            f"keras_dist: {received} is a distributed dataset of unknown length, read "
            f"until it ends: if it never ends (an endless generator), the loop never "
            f"returns; {fix}. Received: {received}="
            + ", ".join(type(source).__name__ for source in sources)
            + f" with {steps_name}=None",
            UserWarning,
            stacklevel=2,
        )
