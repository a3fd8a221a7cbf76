"""A warning when every batch of ``fit`` splits unevenly between the replicas.

A batch whose rows the replicas cannot share evenly (30 rows on 4 replicas)
runs on the uneven path: exact, but compiled per replica shape and run on one
device or replica by replica, several times slower than an even split. A
partial last batch takes it once an epoch; a global batch size that is not a
multiple of the replica count makes every step take it, which a user should
hear about once.
"""

import warnings


class UnevenBatchWarning(UserWarning):
    """Every batch of a ``fit`` splits unevenly between the replicas (a slow path)."""


class UnevenBatchWatch:
    """Warns once when two steps in a row had uneven batches of the same rows.

    (A partial last batch follows full ones; the same uneven size twice in a row
    is the batch size itself.)

    >>> watch = UnevenBatchWatch(replicas=4)
    >>> watch.saw(rows=32, uneven=False); watch.saw(rows=30, uneven=True)
    >>> with warnings.catch_warnings(record=True) as caught:
    ...     warnings.simplefilter("always")
    ...     watch.saw(rows=30, uneven=True)
    >>> "multiple of 4 (28 or 32)" in str(caught[0].message)
    True
    """

    def __init__(self, replicas: int):
        self._replicas = replicas
        self._last_uneven_rows = None
        self._warned = False

    def saw_even(self) -> None:
        """Notes a step whose batch split evenly."""
        self._last_uneven_rows = None

    def saw(self, rows: int, uneven: bool) -> None:
        """Notes one step's global rows and whether they split unevenly."""
        if not uneven:
            self._last_uneven_rows = None
            return
        if rows == self._last_uneven_rows and not self._warned:
            self._warned = True
            n = self._replicas
            lower, upper = rows // n * n, -(-rows // n) * n
            warnings.warn(
                f"Every batch of {rows} rows splits unevenly between the {n} replicas, so "
                "every step runs on keras_dist's path for uneven batches: exact, but "
                "compiled per replica shape and several times slower than an even split. "
                f"Use a global batch size that is a multiple of {n} ({lower} or {upper}).",
                UnevenBatchWarning,
                stacklevel=2,
            )
        self._last_uneven_rows = rows
