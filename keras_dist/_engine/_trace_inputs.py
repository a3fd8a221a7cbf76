"""What a replica function's trace takes in: its inputs sorted, the variables it met.

``sort_inputs`` splits a call's flattened arguments into the program's array
inputs and the trace's constants (which, with the arrays' shapes, name the
program); ``absorb_discoveries`` takes in the variables a trace met that were
not threaded yet, so that the engine traces once more with them.
"""

import jax
import numpy as np

from keras_dist import _context
from keras_dist._engine._key_parts import static_key
from keras_dist._keras import initialize_pending_variables
from keras_dist._keras import pending_variables
from keras_dist._keras import variable_has_value
from keras_dist._values import DistributedValues
from keras_dist._values import PerReplica
from keras_dist._values._variables import DistributedVariable


def sort_inputs(leaves, per_replica, one_value):
    """Sorts a replica function's flattened inputs into program arguments and constants.

    A ``PerReplica`` leaf becomes ``per_replica(leaf)`` (kind ``"r"``); another
    distributed value or an array, ``one_value(leaf)`` (kind ``"m"``); anything
    else is a constant of the trace (kind ``None``). Returns ``(kinds, dynamic,
    signature, statics)``: the signature (shapes and dtypes) and the statics'
    keys identify the program.
    """
    kinds, dynamic, signature, statics = [], [], [], []
    for index, leaf in enumerate(leaves):
        if isinstance(leaf, PerReplica):
            value, kind = per_replica(leaf), "r"
        elif isinstance(leaf, (DistributedValues, jax.Array, np.ndarray, np.generic)):
            value, kind = one_value(leaf), "m"
        else:
            kinds.append(None)
            statics.append((index, static_key(leaf)))
            continue
        kinds.append(kind)
        dynamic.append(value)
        if isinstance(value, list):  # one array per replica (shapes may differ)
            signature.append((kind, tuple(_array_signature(x) for x in value)))
        else:
            signature.append((kind,) + _array_signature(value))
    return kinds, dynamic, signature, statics


def _array_signature(array) -> tuple:
    return (array.shape, array.dtype, getattr(array, "weak_type", False))


def absorb_discoveries(strategy, unmapped, foreign) -> bool:
    """Takes in variables a trace met for the first time; True to trace again.

    Variables created during the trace get their first values; ``unmapped``
    ones (read but not threaded as state) that the strategy did not create are
    added to ``foreign`` (a ``WeakValueDictionary`` by id), to be threaded.
    """
    again = False
    if pending_variables():
        with _context.push(_context.Frame(strategy, None)):
            initialize_pending_variables()
        again = True
    for variable in unmapped:
        if not variable_has_value(variable):
            continue
        if isinstance(variable, DistributedVariable):
            if variable.distribute_strategy is not strategy:
                raise RuntimeError(
                    "Mixing different tf.distribute.Strategy objects: variable "
                    f"{variable.path!r} was created under another strategy and used "
                    f"in `run` of {type(strategy).__name__}."
                )
            again = True  # created after the state was taken
        elif id(variable) not in foreign:
            foreign[id(variable)] = variable
            again = True
    return again
