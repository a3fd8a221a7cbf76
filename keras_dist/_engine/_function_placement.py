"""Where a ``kd.function``'s array arguments and results live, so they mix with eager ones.

A cross-replica result outside a program (``strategy.reduce``, a step run as
Python for a partial batch) is an array on the first device, as TF's lands on
the host. A program's replicated result is brought to the same place, and an
array argument committed elsewhere is moved to where the program takes it:
otherwise ``total += step(batch)`` over full and partial batches, or an eager
result passed to a compiled step, would meet JAX's "incompatible devices".
"""

import jax

from keras_dist._mesh import PlacedAlike


def for_trace(x):
    """An array argument as the program is traced for it: an array on one device by its
    shape alone (the program places it where its other inputs are; the call moves it)."""
    if isinstance(x, jax.Array) and len(x.sharding.device_set) == 1:
        return jax.ShapeDtypeStruct(x.shape, x.dtype, weak_type=x.weak_type)
    return x


class ProgramPlacement:
    """Where a program takes its array arguments; moves the ones committed elsewhere.

    >>> import jax, numpy as np
    >>> placement = ProgramPlacement([jax.sharding.SingleDeviceSharding(jax.devices()[0])])
    >>> [x] = placement.of([jax.device_put(np.ones(2), jax.devices()[0])])
    >>> x.sharding.device_set == {jax.devices()[0]}
    True
    """

    def __init__(self, shardings):
        self._shardings = shardings
        self._placed_alike = PlacedAlike()

    def of(self, arrays) -> list:
        """``arrays`` (a program's array arguments) on the shardings it was compiled for."""
        return [self._placed(x, sharding) for x, sharding in zip(arrays, self._shardings)]

    def _placed(self, x, sharding):
        # ``None``: an argument the program never reads (``jax.jit`` drops it).
        if sharding is None or not isinstance(x, jax.Array) or not x.committed:
            return x
        return x if self._placed_alike(x, sharding) else jax.device_put(x, sharding)


def on_first_device(x):
    """A result replicated over several devices of this process, as its first device's copy.

    No copy is made: the first device already holds it.
    """
    if not isinstance(x, jax.Array):
        return x
    sharding = x.sharding
    if len(sharding.device_set) > 1 and x.is_fully_addressable and sharding.is_fully_replicated:
        return x.addressable_data(0)
    return x
