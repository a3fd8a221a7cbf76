"""A ``kd.function``'s outputs: flattened to the program's arrays, and rebuilt from them.

Distributed values leave the program as their storage (a ``PerReplica`` as its
stacked array and its replicas' sum, a ``Mirrored`` as its replicated array);
everything else that is not an array is kept from the trace.
"""

import jax
import jax.numpy as jnp
import numpy as np

from keras_dist._engine._function_placement import on_first_device
from keras_dist._keras import KerasVariable
from keras_dist._values import DistributedValues
from keras_dist._values import Mirrored
from keras_dist._values import PerReplica
from keras_dist._values._local_results import LocalResults


def _traced(x) -> bool:
    return isinstance(x, jax.core.Tracer)


_PER_REPLICA, _MIRRORED, _ARRAY = object(), object(), object()


def flatten_outputs(outputs):
    """``(arrays, record)``: the traced ``outputs``' arrays, and how to rebuild them."""
    leaves, treedef = jax.tree_util.tree_flatten(outputs, is_leaf=_is_output_leaf)
    arrays, layout = [], []
    for leaf in leaves:
        if isinstance(leaf, KerasVariable):
            leaf = leaf.value
        if isinstance(leaf, PerReplica) and _traced(leaf.stacked):
            arrays.append((leaf.stacked, leaf.replica_sum))
            layout.append(_PER_REPLICA)
        elif isinstance(leaf, Mirrored) and _traced(leaf.replicated):
            arrays.append(leaf.replicated)
            layout.append(_MIRRORED)
        elif isinstance(leaf, (jax.Array, np.ndarray, np.generic)) or _traced(leaf):
            arrays.append(jnp.asarray(leaf))
            layout.append(_ARRAY)
        else:
            layout.append(leaf)
    nodes = jax.tree_util.tree_leaves(outputs, is_leaf=lambda x: isinstance(x, LocalResults))
    cut_to_local = any(isinstance(x, LocalResults) for x in nodes)
    return arrays, (treedef, layout, cut_to_local)


def rebuild_outputs(treedef, layout, arrays, one_device=False):
    """The outputs as the function returned them, from a call's ``arrays`` and the record.

    ``one_device``: the program ran on one device (its arrays are already where an
    eager result would be).
    """
    arrays = iter(arrays)
    place = _as_they_are if one_device else on_first_device
    leaves = []
    for slot in layout:
        if slot is _PER_REPLICA:
            stacked, total = next(arrays)
            value = PerReplica(None, _stacked=stacked, _validate=False)
            value.replica_sum = total
            leaves.append(value)
        elif slot is _MIRRORED:
            leaves.append(Mirrored(None, _replicated=next(arrays), _validate=False))
        elif slot is _ARRAY:
            leaves.append(place(next(arrays)))
        else:
            leaves.append(slot)
    return jax.tree_util.tree_unflatten(treedef, leaves)


def _as_they_are(x):
    return x


def _is_output_leaf(x):
    return x is None or isinstance(x, (DistributedValues, KerasVariable))
