"""A compiled step donates the variables' arrays: each must be a buffer of its own.

Donation hands a program its arguments' buffers to overwrite, so one buffer
must never be passed twice. ``copy_shared_storage`` and ``copy_shared_buffers``
copy the arrays that share one; ``StoredOutputs`` lets a program called again
on the state it left skip those checks (and the placement check), which are a
good part of a small step's host time.

>>> import jax.numpy as jnp
>>> a = jnp.ones(2)
>>> values = [a, a]
>>> copy_shared_buffers(values)
>>> values[0] is values[1]
False
"""

import weakref

import jax.numpy as jnp


def copy_shared_storage(variables, values) -> None:
    """Copies ``values[i]`` where ``variables[i]`` stores the same array as an earlier one.

    A variable assigned from another (an EMA slot set to its model variable) stores the
    very same array; on one device ``compute_value`` wraps each in a new ``jax.Array``
    around that one buffer, which donation would then be handed twice.
    """
    seen = set()
    for i, variable in enumerate(variables):
        key = id(variable.stored())
        if key in seen:
            values[i] = jnp.copy(values[i])
        seen.add(key)


def copy_shared_buffers(*lists):
    """Donation needs distinct buffers; a variable assigned from another shares one."""
    if len({id(v) for values in lists for v in values}) == sum(map(len, lists)):
        return
    seen = set()
    for values in lists:
        for i, value in enumerate(values):
            if id(value) in seen:
                values[i] = jnp.copy(value)
            seen.add(id(value))


def copy_stored_arguments(arguments: list, stored: list) -> None:
    """Copies each of ``arguments`` that is one of the variables' ``stored`` arrays.

    Where a variable is read placed anew for a program, on one device the new
    array can be the stored buffer under another sharding's name: an argument
    that is the stored array itself (``strategy.run(fn, args=(w.value,))``) would
    then share a buffer with the donated state, unseen by ``copy_shared_buffers``.
    """
    if not arguments:
        return
    ids = {id(x) for x in stored}
    for i, argument in enumerate(arguments):
        if id(argument) in ids:
            arguments[i] = jnp.copy(argument)


def keep_placed(variables, values) -> bool:
    """Stores each of ``values``, a read-only mirrored variable's array placed for a
    program, in its variable; whether the strategy kept them as they are.

    Otherwise a variable stored elsewhere (the learning rate, made on one device) is
    placed anew on every call, and the program reads every variable again, since
    they no longer hold the arrays its last call left. A strategy that stores
    variables apart (on a central device) moves them back instead: the caller
    stops asking.
    """
    for variable, value in zip(variables, values):
        if variable.stored() is not value:
            variable.distribute_strategy.extended.store_computed(variable, value)
            if variable.stored() is not value:
                return False
    return True


class StoredOutputs:
    """Whether variables still hold the arrays a program's last call output for them.

    Those are the program's own outputs: placed as it takes them and each a
    buffer of its own, so the next call can pass them as they are. Held weakly:
    an array a variable no longer holds is freed as before. A strategy that
    stores copies (a parameter device) never holds them: its calls read anew.

    >>> import jax.numpy as jnp
    >>> outputs = [jnp.zeros(2), jnp.ones(2)]
    >>> kept = StoredOutputs()
    >>> kept.remember(outputs)
    >>> kept.unchanged(outputs), kept.unchanged([outputs[0], jnp.ones(2)])
    (True, False)
    """

    def __init__(self):
        self._refs = None

    def remember(self, outputs: list) -> None:
        """Notes the program's new state ``outputs``, one per variable, in order."""
        self._refs = list(map(weakref.ref, outputs))

    def unchanged(self, stored: list) -> bool:
        """Whether ``stored`` (one program's variables, in order) are the arrays remembered."""
        refs = self._refs
        return refs is not None and all(r() is a for r, a in zip(refs, stored))
