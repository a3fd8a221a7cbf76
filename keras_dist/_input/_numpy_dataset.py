"""``NumpyDataset``: the rows of a nest of NumPy arrays, batched."""

import numbers

import jax
import numpy as np


class NumpyDataset:
    """The rows of a nest of NumPy arrays; ``batch(n)`` makes global batches.

    >>> ds = NumpyDataset(np.arange(5)).batch(2)
    >>> [b.tolist() for b in ds]
    [[0, 1], [2, 3], [4]]
    """

    def __init__(self, numpy_input, batch_size=None, drop_remainder=False):
        self._data = jax.tree_util.tree_map(np.asarray, numpy_input)
        self._size = _row_count(self._data)
        self._batch_size = batch_size
        self._drop_remainder = drop_remainder

    def batch(self, batch_size: int, drop_remainder: bool = False) -> "NumpyDataset":
        """Groups rows into batches of ``batch_size`` (the last may be smaller)."""
        if isinstance(batch_size, bool) or not isinstance(batch_size, numbers.Integral):
            raise TypeError(
                "batch_size must be a positive integer: the number of rows in each "
                f"batch, e.g. .batch(32). Received: batch_size={batch_size!r}"
            )
        if batch_size < 1:
            raise ValueError(
                "batch_size must be a positive integer: the number of rows in each "
                f"batch, e.g. .batch(32). Received: batch_size={batch_size!r}"
            )
        return NumpyDataset(self._data, int(batch_size), drop_remainder)

    @property
    def batch_size(self) -> "int | None":
        """Rows per batch; ``None`` before ``batch()`` (the elements are rows)."""
        return self._batch_size

    @property
    def static_shapes(self) -> bool:
        """Whether every element has the same shape: rows, or batches without a remainder.

        As TF's ``element_spec``: ``batch(n)`` alone leaves the batch size unknown
        (the last batch may be smaller), even when ``n`` divides the rows.
        """
        return self._batch_size is None or self._drop_remainder

    def __len__(self):
        if self._batch_size is None:
            return self._size
        full, rest = divmod(self._size, self._batch_size)
        return full + (1 if rest and not self._drop_remainder else 0)

    def __iter__(self):
        step = self._batch_size or 1
        for start in range(0, len(self) * step, step):
            if self._batch_size is None:
                yield jax.tree_util.tree_map(lambda x, s=start: x[s], self._data)
            else:
                yield jax.tree_util.tree_map(lambda x, s=start: x[s : s + step], self._data)


def _row_count(data) -> int:
    """The rows every array of ``data`` has; fails, naming each count, where they differ.

    >>> _row_count((np.ones((10, 2)), np.ones((9, 1))))
    Traceback (most recent call last):
    ...
    ValueError: Every array of a NumPy dataset must have the same number of rows ...
    Received: rows=10 at [0], rows=9 at [1]
    """
    leaves = jax.tree_util.tree_leaves_with_path(data)
    scalars = [jax.tree_util.keystr(path) or "the input" for path, x in leaves if x.ndim == 0]
    if scalars:
        raise ValueError(
            "A NumPy dataset's elements are the rows of its arrays, so every array needs "
            "a first dimension: pass arrays of rank 1 or more (np.reshape(x, (-1,)) for "
            f"one row per value). Received: a scalar at {', '.join(scalars)}"
        )
    counts = [(jax.tree_util.keystr(path) or "the input", len(x)) for path, x in leaves]
    if len({count for _, count in counts}) > 1:
        raise ValueError(
            "Every array of a NumPy dataset must have the same number of rows (its first "
            "dimension): the dataset's elements are their rows, taken together. Pass "
            "arrays of equal length. Received: "
            + ", ".join(f"rows={count} at {path}" for path, count in counts)
        )
    return counts[0][1] if counts else 0
