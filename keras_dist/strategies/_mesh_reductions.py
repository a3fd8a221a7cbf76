"""Cross-replica reductions of a mesh strategy outside compiled programs.

``strategy.reduce`` with an axis, ``strategy.gather``, and where reduced values
go (``destinations``). Each works on the components a process holds and
communicates across processes only through ``Placement``'s collectives.
"""

import jax
import jax.numpy as jnp
import numpy as np

from keras_dist._devices import resolve_device
from keras_dist._reduce_op import ReduceOp
from keras_dist._reduce_op import mean_of
from keras_dist._values import DistributedValues
from keras_dist._values import regroup
from keras_dist._values._variables import DistributedVariable


def destination_devices(local_devices, destinations) -> tuple:
    """The devices ``destinations`` names; the replicas' own by default."""
    if destinations is None or isinstance(destinations, DistributedVariable):
        return local_devices
    if isinstance(destinations, DistributedValues):
        # As in TF, the result goes where the destination value lives, which
        # may be other devices than the replicas' (a Mirrored on one CPU).
        return _committed_devices(destinations) or local_devices
    if isinstance(destinations, (str, jax.Device)):
        return (resolve_device(destinations),)
    if isinstance(destinations, (list, tuple)):
        return tuple(resolve_device(d) for d in destinations)
    return local_devices


def _committed_devices(value):
    """The devices of ``value``'s components when each is committed to its own device.

    ``None`` when the components are on the strategy's mesh (stacked, replicated
    or traced), are Python scalars, or were left on the default device.
    """
    if value.components is None:
        return None
    devices = []
    for component in value.components:
        if not isinstance(component, jax.Array) or not component.committed:
            return None
        component_devices = component.devices()
        if len(component_devices) != 1:
            return None
        devices.append(next(iter(component_devices)))
    if len(set(devices)) != len(devices):
        return None
    return tuple(devices)


def first(value):
    """A reduced value as one array on the first device (cheap: no copy)."""
    if isinstance(value, DistributedValues):
        if value.replicated is not None:
            return value.replicated.addressable_data(0)
        return value.values[0]
    if isinstance(value, jax.Array) and len(value.sharding.device_set) > 1:
        return value.addressable_data(0)
    return value


def mean_from_sum(reduce_op, total, count, integer_division=False):
    """``total`` for SUM, ``total / count`` for MEAN (floor division if asked, for integers)."""
    if reduce_op is ReduceOp.SUM:
        return total
    return mean_of(total, count, integer_division)


def reduce_stacked_in_program(reduce_op, value, axis):
    """``strategy.reduce`` of a stacked result inside a compiled program (``kd.function``)."""
    stacked = value.stacked
    if axis is None:
        total = value.replica_sum if value.replica_sum is not None else jnp.sum(stacked, axis=0)
        if reduce_op is ReduceOp.SUM:
            return total
        return total / stacked.shape[0]
    per_replica_axis = axis + 1 if axis >= 0 else axis
    if reduce_op is ReduceOp.SUM:
        return jnp.sum(stacked, axis=(0, per_replica_axis))
    return jnp.mean(stacked, axis=(0, per_replica_axis))


def reduce_along_axis(placement, reduce_op, value, axis):
    """Every replica's component reduced along ``axis``, then across replicas."""
    if value.stacked is not None:
        return first(placement.execute(_stacked_axis_reducer(reduce_op, axis), value.stacked))
    # Uneven components (e.g. a partial last batch): reduce each, then add up.
    target = placement.local_devices[0]
    components = [jnp.asarray(c) for c in value.values]
    total = sum(jax.device_put(jnp.sum(c, axis=axis), target) for c in components)
    count = sum(c.shape[axis] for c in components)
    if placement.spans_processes:
        total, count = placement.cross_process_sum((total, np.asarray(count)))
    if reduce_op is ReduceOp.SUM:
        return total
    return total / count


_AXIS_REDUCERS: dict = {}


def _stacked_axis_reducer(reduce_op, axis):
    key = (reduce_op, axis)
    if key not in _AXIS_REDUCERS:

        def reduce(stacked):
            per_replica_axis = axis + 1 if axis >= 0 else axis
            if reduce_op is ReduceOp.SUM:
                return jnp.sum(stacked, axis=(0, per_replica_axis))
            return jnp.mean(stacked, axis=(0, per_replica_axis))

        _AXIS_REDUCERS[key] = jax.jit(reduce)
    return _AXIS_REDUCERS[key]


def gather(placement, components, axis):
    """Every replica's component concatenated on ``axis``, on every process."""
    if placement.spans_processes:
        return _gather_across_processes(placement, components, axis)
    target = placement.local_devices[0]
    return jnp.concatenate([jax.device_put(jnp.asarray(c), target) for c in components], axis=axis)


def _gather_across_processes(placement, components, axis):
    """Components may differ in size on ``axis`` (partial batches).

    The sizes are exchanged first, and each component travels padded to the
    largest.
    """
    components = [jnp.asarray(c) for c in components]
    axis = axis % components[0].ndim
    sizes = np.zeros(placement.num_replicas, np.int32)
    for i, c in enumerate(components):
        sizes[placement.first_local_replica_id + i] = c.shape[axis]
    sizes = np.asarray(placement.cross_process_sum(sizes))
    largest = int(sizes.max())

    def pad(c):
        widths = [(0, 0)] * c.ndim
        widths[axis] = (0, largest - c.shape[axis])
        return jnp.pad(c, widths)

    everything = placement.all_rows(placement.stack_components([pad(c) for c in components]))
    pieces = [
        jax.lax.slice_in_dim(everything[i], 0, int(size), axis=axis) for i, size in enumerate(sizes)
    ]
    return jnp.concatenate(pieces, axis=axis)


def regroup_always(per_replica: list):
    """One ``PerReplica`` per leaf, even where every replica gave the same object."""
    return regroup(per_replica, always_wrap=True)
