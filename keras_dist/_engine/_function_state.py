"""How a ``kd.function`` program reads and writes each variable it threads as state.

Decided once per variable when a program is built: a step's host work is the
loop over its state, so it should not ask each variable what it is.
"""

import functools

import jax

from keras_dist._capabilities import MeshRuntime
from keras_dist._keras import KerasVariable
from keras_dist._values._variables import DistributedVariable
from keras_dist._values._variables import SyncOnReadVariable


def state_access(variable, extendeds):
    """``(read, write)`` of ``variable`` as program state (unbound: the program holds it weakly)."""
    if isinstance(variable, SyncOnReadVariable):
        return (lambda v: v.stored()), (lambda v, value: v.store(value))
    if isinstance(variable, DistributedVariable):
        extended = variable.distribute_strategy.extended
        return extended.compute_value, extended.store_computed
    return functools.partial(state_value, extendeds=extendeds), _store_state


def holding(variable):
    """How to read the array ``variable`` holds as it is (unbound, like ``_state_access``).

    A distributed variable's stored array (a SyncOnRead one: its stacked
    components); a Keras variable's value (a cast copy under autocast: never the same).
    """
    if isinstance(variable, DistributedVariable):
        return type(variable).stored
    return _keras_value


def _keras_value(variable):
    return variable.value


def state_value(variable, extendeds):
    if isinstance(variable, SyncOnReadVariable):
        return variable.stored()
    if isinstance(variable, DistributedVariable):
        return variable.distribute_strategy.extended.compute_value(variable)
    value = variable.value
    if extendeds and isinstance(extendeds[0], MeshRuntime):
        return extendeds[0].placement.replicate(value)  # beside the strategy's arrays
    return value


def _store_state(variable, value):
    if isinstance(variable, SyncOnReadVariable):
        variable.store(value)
    elif isinstance(variable, DistributedVariable):
        variable.distribute_strategy.extended.store_computed(variable, value)
    else:
        KerasVariable.assign(variable, value)


def is_mirrored(variable) -> bool:
    """Whether ``variable`` is a mirrored (not SyncOnRead) distributed variable."""
    return isinstance(variable, DistributedVariable) and not isinstance(
        variable, SyncOnReadVariable
    )


def keep_sharding(new, sharding):
    """A variable's new value with the sharding its old value had (a SyncOnRead variable
    written outside the replicas would otherwise come out replicated)."""
    if sharding is None:
        return new
    return jax.lax.with_sharding_constraint(new, sharding)
