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
