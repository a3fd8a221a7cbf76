"""Sparse inputs become dense before a batch is split between replicas.

Keras accepts SciPy sparse matrices, JAX ``BCOO`` arrays and TensorFlow
``SparseTensor``s (from a ``tf.data`` pipeline) as model inputs. A
strategy splits each global batch along its rows, which a sparse array's
leaves (values and indices) do not have, and places the pieces on devices: the
batch is densified first, so every replica gets its rows and the model computes
what it computes on one device.

>>> import numpy as np
>>> from jax.experimental import sparse
>>> batch = (sparse.BCOO.fromdense(np.eye(2, dtype="float32")), np.ones((2, 1)))
>>> [np.asarray(x).tolist() for x in densify(batch)]
[[[1.0, 0.0], [0.0, 1.0]], [[1.0], [1.0]]]
"""

import jax
import numpy as np
from jax.experimental import sparse as jax_sparse


def _is_tf_sparse(x) -> bool:
    # Without importing TensorFlow, which is never a dependency.
    kind = type(x)
    return kind.__name__ == "SparseTensor" and kind.__module__.startswith("tensorflow")


def _is_sparse(x) -> bool:
    if type(x) is np.ndarray:  # the common case, once per leaf of every batch
        return False
    if isinstance(x, jax_sparse.JAXSparse) or _is_tf_sparse(x):
        return True
    # SciPy's sparse classes, without importing SciPy when it is not used.
    return type(x).__module__.startswith("scipy.sparse") and hasattr(x, "toarray")


def _tf_sparse_to_dense(x) -> np.ndarray:
    values = np.asarray(x.values)
    dense = np.zeros(tuple(np.asarray(x.dense_shape)), values.dtype)
    # tf.sparse.to_dense's rule: each index is given once.
    dense[tuple(np.asarray(x.indices).T)] = values
    return dense


def _dense(x):
    if isinstance(x, jax_sparse.JAXSparse):
        return np.asarray(x.todense())
    if _is_tf_sparse(x):
        return _tf_sparse_to_dense(x)
    return x.toarray() if _is_sparse(x) else x


def densify(batch):
    """``batch`` with every sparse array replaced by its dense NumPy array."""
    leaves = jax.tree_util.tree_leaves(batch, is_leaf=_is_sparse)
    if not any(map(_is_sparse, leaves)):
        return batch
    return jax.tree_util.tree_map(_dense, batch, is_leaf=_is_sparse)
