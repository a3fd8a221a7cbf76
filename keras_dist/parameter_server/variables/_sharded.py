"""``ShardedVariable``: one variable split along its first axis into several (TF's).

Variables a ``ParameterServerStrategy`` partitions are ``ShardedVariable`` s
(their shards on several ps tasks); one can also be built from a list of
Keras variables. It reads as the whole array, ``assign`` splits a value
between the shards, and ``embedding_lookup`` gathers rows.

>>> import keras, numpy as np
>>> v = ShardedVariable([keras.Variable([[1.0, 2.0]]), keras.Variable([[3.0, 4.0], [5.0, 6.0]])])
>>> v.shape, np.asarray(v).tolist()
((3, 2), [[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]])
>>> v.embedding_lookup([2, 0]).tolist()
[[5.0, 6.0], [1.0, 2.0]]
"""

import abc

import jax
import keras
import numpy as np

from keras_dist import errors


# An ABC without abstract methods: partitioned ps variables register as one.
class ShardedVariable(metaclass=abc.ABCMeta):  # noqa: B024
    """A variable made of ``variables``, its shards along the first axis, in order.

    Args:
        variables: a non-empty list of Keras variables of one dtype whose
            shapes agree except along the first axis.
        name: the variable's name.

    >>> import keras, numpy as np
    >>> v = ShardedVariable([keras.Variable([1.0, 2.0]), keras.Variable([3.0])])
    >>> _ = v.assign([4.0, 5.0, 6.0])
    >>> [np.asarray(shard).tolist() for shard in v.variables]
    [[4.0, 5.0], [6.0]]
    """

    def __init__(self, variables, name="ShardedVariable"):
        if (
            not isinstance(variables, (list, tuple))
            or not variables
            or not all(isinstance(v, keras.Variable) for v in variables)
        ):
            raise TypeError(
                "Argument `variables` should be a non-empty list of `keras.Variable`s. "
                f"Received: variables={variables!r}"
            )
        dtypes = [v.dtype for v in variables]
        if len(set(dtypes)) > 1:
            raise ValueError(
                "All elements in argument `variables` must have the same dtype. "
                f"Received dtypes: {dtypes}"
            )
        shapes = [tuple(v.shape) for v in variables]
        if len({s[1:] for s in shapes}) > 1 or any(not s for s in shapes):
            raise ValueError(
                "All elements in argument `variables` must have the same shapes except for "
                f"the first axis. Received shapes: {shapes}"
            )
        self._variables = list(variables)
        self.name = name

    @property
    def variables(self) -> list:
        """The shards, in row order."""
        return list(self._variables)

    @property
    def shape(self) -> tuple:
        first = sum(int(v.shape[0]) for v in self._variables)
        return (first, *tuple(self._variables[0].shape)[1:])

    @property
    def dtype(self):
        return self._variables[0].dtype

    def numpy(self):
        """The whole value (the shards concatenated)."""
        return np.concatenate([np.asarray(v) for v in self._variables], axis=0)

    def __array__(self, dtype=None, copy=None):
        value = self.numpy()
        return value if dtype is None else value.astype(dtype)

    @property
    def value(self):
        return keras.ops.concatenate([v.value for v in self._variables], axis=0)

    def __jax_array__(self):
        return self.value

    def _split(self, value):
        bounds = np.cumsum([int(v.shape[0]) for v in self._variables])[:-1]
        return np.split(np.asarray(value), bounds, axis=0)

    def assign(self, value):
        """Writes ``value`` (the whole array), each shard its rows; returns ``self``."""
        for variable, piece in zip(self._variables, self._split(value)):
            variable.assign(piece)
        return self

    def assign_add(self, value):
        for variable, piece in zip(self._variables, self._split(value)):
            variable.assign_add(piece)
        return self

    def assign_sub(self, value):
        for variable, piece in zip(self._variables, self._split(value)):
            variable.assign_sub(piece)
        return self

    def _scatter(self, indices, updates, combine):
        value = self.numpy()
        indices = np.asarray(indices)
        combine(value, indices, np.asarray(updates, dtype=value.dtype))
        return self.assign(value)

    def scatter_update(self, indices, updates):
        """Rows ``indices`` replaced by ``updates`` (TF's ``scatter_update`` of IndexedSlices)."""
        return self._scatter(indices, updates, lambda v, i, u: v.__setitem__(i, u))

    def scatter_add(self, indices, updates):
        return self._scatter(indices, updates, np.add.at)

    def scatter_sub(self, indices, updates):
        return self._scatter(indices, updates, np.subtract.at)

    def scatter_max(self, indices, updates):
        return self._scatter(indices, updates, np.maximum.at)

    def scatter_min(self, indices, updates):
        return self._scatter(indices, updates, np.minimum.at)

    def embedding_lookup(self, ids):
        """Rows ``ids`` of the whole variable (``tf.nn.embedding_lookup``)."""
        return lookup_rows(self.value, ids)

    def __repr__(self):
        return f"<ShardedVariable {self.name} shape={self.shape} shards={len(self._variables)}>"


def lookup_rows(table, ids):
    """Rows ``ids`` of ``table``; an id outside it raises, as TF's lookup does, where it is
    known (outside a compiled program: inside one JAX gives NaN rows for it).

    >>> lookup_rows(np.eye(2, dtype="float32"), [1]).tolist()
    [[0.0, 1.0]]
    """
    ids = keras.ops.convert_to_tensor(ids)
    if not isinstance(ids, jax.core.Tracer):
        _check_ids(np.asarray(ids), table.shape[0])
    return keras.ops.take(table, ids, axis=0)


def _check_ids(ids, rows) -> None:
    outside = np.flatnonzero((ids < 0) | (ids >= rows))
    if outside.size:
        index = np.unravel_index(outside[0], ids.shape) if ids.ndim else ()
        where = ", ".join(str(int(i)) for i in index)
        raise errors.InvalidArgumentError(
            f"indices[{where}] = {int(ids.reshape(-1)[outside[0]])} is not in [0, {rows}): "
            f"`embedding_lookup` takes row ids of the table. Received: ids with "
            f"{outside.size} id(s) outside the table's {rows} rows"
        )
