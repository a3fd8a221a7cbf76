"""The device mesh every strategy runs on, built in one place.

A strategy's mesh has two axes:

* ``"replica"``: one entry per replica. Data is split along it, gradients are
  summed over it, ``replica_id_in_sync_group`` is the index along it.
* ``"logical"``: the devices one replica spans (TF's logical devices, or
  model parallelism inside a replica). Size 1 unless a device assignment
  gives a replica several cores.

>>> import jax
>>> mesh = replica_mesh(jax.devices()[:2])
>>> dict(mesh.shape)
{'replica': 2, 'logical': 1}
"""

from collections.abc import Sequence

import jax
import numpy as np
from jax.sharding import Mesh

REPLICA_AXIS = "replica"
LOGICAL_AXIS = "logical"
AXES = (REPLICA_AXIS, LOGICAL_AXIS)


def replica_mesh(devices: Sequence[jax.Device], cores_per_replica: int = 1) -> Mesh:
    """A ``(replica, logical)`` mesh over ``devices``, ``cores_per_replica`` devices a replica.

    Devices are taken in order: replica ``r`` spans
    ``devices[r * cores_per_replica : (r + 1) * cores_per_replica]``.
    """
    devices = list(devices)
    if cores_per_replica < 1 or len(devices) % cores_per_replica:
        raise ValueError(
            "The devices must split evenly into replicas of `cores_per_replica` devices. "
            f"Received: {len(devices)} devices, cores_per_replica={cores_per_replica}"
        )
    grid = np.array(devices, dtype=object).reshape(-1, cores_per_replica)
    return Mesh(grid, AXES)


class PlacedAlike:
    """Whether an array already lies where a sharding would place it.

    Decided once per (target, array's sharding, rank): a training loop passes
    arrays placed alike on every call, and two shardings may differ only in
    name (one device's ``SingleDeviceSharding`` and a one-device mesh's
    ``P()``), which only the slower ``is_equivalent_to`` sees.

    >>> import jax, numpy as np
    >>> placed_alike = PlacedAlike()
    >>> mesh = replica_mesh(jax.devices()[:1])
    >>> target = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    >>> placed_alike(jax.device_put(np.ones(2), jax.devices()[0]), target)
    True
    """

    _LIMIT = 64  # pairs remembered (a loop sees one or two)

    def __init__(self):
        self._known: dict = {}
        # Per rank, the last (sharding, target, answer), held: a loop's batches share
        # one sharding object, and features and labels (two ranks) alternate.
        self._last: dict = {}

    def __call__(self, array: jax.Array, target) -> bool:
        sharding, ndim = array.sharding, array.ndim
        last = self._last.get(ndim)
        if last is not None and last[0] is sharding and last[1] is target:
            return last[2]  # (no comparing)
        key = (target, sharding, ndim)
        known = True if sharding == target else self._known.get(key)
        if known is None:
            known = sharding.is_equivalent_to(target, ndim)
            if len(self._known) >= self._LIMIT:
                self._known.clear()
            self._known[key] = known
        self._last[ndim] = (sharding, target, known)
        return known
