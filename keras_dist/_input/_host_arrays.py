"""Values from other frameworks, taken wherever NumPy arrays are.

A ported program still hands keras_dist TensorFlow values: batches of a
``tf.data`` pipeline, ``tf.constant`` results of a value function (a ``tf.data.Dataset``'s
sharding option is read in ``keras_dist.data``). TensorFlow is never
imported here: its values are recognised by their type's module, and turned
into NumPy arrays through ``__array__``.

JAX keeps 64-bit integers only in its x64 mode. Without it, ``int64`` input
(TF's default integer dtype, and NumPy's) arrives as ``int32``; that is silent
in JAX, and wrong for ids of 2**31 and more, so it is said once.

>>> import numpy as np
>>> to_host_arrays({"ids": [1, 2]})["ids"]
[1, 2]
"""

import warnings

import jax
import numpy as np

_warned_int64 = False


def is_tensorflow_value(x) -> bool:
    """A TensorFlow tensor or variable (recognised without importing TensorFlow)."""
    module = type(x).__module__ or ""
    return module.startswith("tensorflow") and hasattr(x, "__array__")


def to_host_array(x):
    """``x`` as a NumPy array when it is a TensorFlow value; anything else unchanged."""
    if is_tensorflow_value(x):
        x = np.asarray(x)
    if isinstance(x, np.ndarray):
        warn_if_int64_narrowed(x.dtype)
    return x


def to_host_arrays(tree):
    """Every TensorFlow value of the nest ``tree`` as a NumPy array."""
    return jax.tree_util.tree_map(to_host_array, tree)


def warn_if_int64_narrowed(dtype) -> None:
    """Says once that 64-bit integers become 32-bit ones (JAX's x64 mode is off)."""
    global _warned_int64
    if _warned_int64 or dtype not in (np.int64, np.uint64):
        return
    if jax.config.read("jax_enable_x64"):
        return
    _warned_int64 = True
    warnings.warn(
        f"keras_dist: input of dtype {np.dtype(dtype).name} arrives as "
        f"{'int32' if dtype == np.int64 else 'uint32'}, because JAX keeps 64-bit "
        "integers only in its x64 mode. Values of 2**31 and more would wrap. To keep "
        "64 bits, set JAX_ENABLE_X64=1 (or call "
        "`jax.config.update('jax_enable_x64', True)`) before keras_dist starts; "
        "otherwise cast the input to int32. (Said once.)",
        UserWarning,
        stacklevel=3,
    )
