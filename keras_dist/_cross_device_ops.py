"""`CrossDeviceOps`: the ways values of several replicas are reduced on JAX.

Each implementation is a real, different reduction path; all give the same
numbers. ``reduce_in_replica`` runs inside the compiled engine (under
``shard_map``, one call per replica) on a list of tensors: it packs the small
ones into one buffer per dtype, so a step that reduces 50 gradients issues one
collective, not 50. Reductions in the cross-replica context run the
same function over the stacked components.

* ``NcclAllReduce``: one ``lax.psum`` over the packed small tensors and the
  large ones (XLA combines its operands into one all-reduce). On GPUs XLA
  lowers it to NCCL; on CPU to gloo or in-process collectives.
* ``HierarchicalCopyAllReduce``: a reduce-scatter then an all-gather (the two
  halves of a ring all-reduce), ``num_packs`` buffers at a time.
* ``ReductionToOneDevice``: every component is brought together and added with
  ``accumulation_fn``, then the result is broadcast back.
"""

import functools
import numbers

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import PartitionSpec as P

from keras_dist import _context
from keras_dist._devices import check_device_name
from keras_dist._devices import resolve_device
from keras_dist._mesh import REPLICA_AXIS as AXIS
from keras_dist._reduce_op import ReduceOp
from keras_dist._reduce_op import mean_of
from keras_dist._values import DistributedValues
from keras_dist._values import Mirrored
from keras_dist._values import unstack


def _pack(leaves, max_packed_elements=None):
    """Packs ``leaves`` into few operands: one 1-D buffer per dtype for the small ones.

    Leaves larger than ``max_packed_elements`` stay operands of their own:
    copying them into a buffer costs more than the collective saves (XLA
    combines the operands of one ``psum`` into a single all-reduce anyway).
    Returns the operands and a function that unpacks reduced operands.
    """
    groups: dict = {}
    alone = []
    for index, leaf in enumerate(leaves):
        size = int(np.prod(jnp.shape(leaf)))
        if max_packed_elements is not None and size > max_packed_elements:
            alone.append(index)
        else:
            groups.setdefault(jnp.result_type(leaf), []).append(index)
    operands = []
    for indices in groups.values():
        parts = [jnp.ravel(leaves[i]) for i in indices]
        operands.append(parts[0] if len(parts) == 1 else jnp.concatenate(parts))
    operands.extend(leaves[i] for i in alone)

    def unpack(reduced):
        out = [None] * len(leaves)
        for indices, buffer in zip(groups.values(), reduced):
            offset = 0
            for i in indices:
                size = int(np.prod(jnp.shape(leaves[i])))
                out[i] = jnp.reshape(buffer[offset : offset + size], jnp.shape(leaves[i]))
                offset += size
        for i, value in zip(alone, reduced[len(groups) :]):
            out[i] = value
        return out

    return operands, unpack


class CrossDeviceOps:
    """Base class of the reduction paths; pass one as ``MirroredStrategy(cross_device_ops=...)``.

    ``reduce``, ``batch_reduce`` and ``broadcast`` work on distributed values in
    the cross-replica context, as in TF.

    >>> import keras_dist as kd
    >>> strategy = kd.MirroredStrategy(["/cpu:0", "/cpu:1"])
    >>> ops = kd.ReductionToOneDevice()
    >>> isinstance(ops, kd.CrossDeviceOps)
    True
    >>> with strategy.scope():
    ...     total = ops.reduce("SUM", kd.PerReplica((1.0, 2.0)), destinations=None)
    >>> [float(v) for v in strategy.experimental_local_results(total)]
    [3.0, 3.0]
    """

    def __init__(self):
        self._jitted: dict = {}

    def check_devices(self) -> None:
        """Raises where the ops name a device this host lacks; called when a strategy takes them.

        JAX's devices are known only then: a multi-process job starts
        ``jax.distributed`` before JAX's backends.
        """

    def reduce(self, reduce_op, per_replica_value, destinations, options=None):
        """Reduces ``per_replica_value`` and places the result on ``destinations``."""
        return self.batch_reduce(reduce_op, [(per_replica_value, destinations)], options)[0]

    def batch_reduce(self, reduce_op, value_destination_pairs, options=None):
        """Reduces several values at once: one fused reduction for all of them."""
        if not _context.has_strategy():
            # Outside any strategy's scope, as TF's ops allow: the components are
            # added on the destination's device.
            reduce_op = ReduceOp.from_value(reduce_op)
            return [
                _reduce_unscoped(self._add_components, reduce_op, value, destinations)
                for value, destinations in value_destination_pairs
            ]
        strategy = _context.get_strategy()
        return strategy.extended.batch_reduce_to(reduce_op, value_destination_pairs, options)

    def broadcast(self, tensor, destinations):
        """Copies ``tensor`` to every destination device, as a ``Mirrored`` value."""
        if not _context.has_strategy():
            return _place_unscoped(jnp.asarray(tensor), destinations)
        return _context.get_strategy().extended.broadcast_to(tensor, destinations)

    def _add_components(self, components):
        return _add_n(components)

    def reduce_in_replica(
        self, reduce_op: ReduceOp, leaves: list, num_replicas: int, *, true_mean=False
    ) -> list:
        """Reduces ``leaves`` across the ``"replica"`` axis; call under ``shard_map``.

        A ``MEAN`` of integers divides as integers, unless ``true_mean``: TF's
        ``MirroredStrategy`` gives a float there (1 and 2 give 1.5), its collectives
        across workers and a variable's own reads give integers.
        """
        if not leaves:
            return []
        if num_replicas == 1:
            return list(leaves)  # nothing to combine; packing would only copy
        operands, unpack = _pack(leaves, self._max_packed_elements)
        reduced = self._reduce_operands(operands, num_replicas)
        if reduce_op is ReduceOp.MEAN:
            reduced = [mean_of(b, num_replicas, not true_mean) for b in reduced]
        return unpack(reduced)

    _max_packed_elements = None  # pack everything

    def _reduce_operands(self, operands, num_replicas):
        return [self._reduce_buffer(b, num_replicas) for b in operands]

    def _reduce_buffer(self, buffer, num_replicas):
        # The base class (or a subclass of the user's that overrides nothing) all-reduces
        # each buffer as one collective, as ``NcclAllReduce`` does.
        return lax.psum(buffer, AXIS)

    def reduce_components(self, placement, reduce_op, stacked_leaves, true_mean=False):
        """Cross-replica reduction of stacked ``(n, ...)`` arrays; results replicated.

        ``placement`` is the strategy's ``Placement`` (its mesh and executor);
        ``true_mean`` as in ``reduce_in_replica``.
        """
        key = (placement.mesh, reduce_op, len(stacked_leaves), true_mean)
        fn = self._jitted.get(key)
        if fn is None:
            n = placement.num_replicas

            def body(*leaves):
                firsts = [x[0] for x in leaves]
                return tuple(self.reduce_in_replica(reduce_op, firsts, n, true_mean=true_mean))

            fn = jax.jit(
                jax.shard_map(
                    body,
                    mesh=placement.mesh,
                    in_specs=P(AXIS),
                    out_specs=P(),
                    check_vma=False,
                )
            )
            self._jitted[key] = fn
        return list(placement.execute(fn, *stacked_leaves))

    def __repr__(self):
        return f"{type(self).__name__}()"


class NcclAllReduce(CrossDeviceOps):
    """All-reduce of packed buffers (``lax.psum``): NCCL on GPUs.

    >>> import keras_dist as kd
    >>> strategy = kd.MirroredStrategy(["/cpu:0", "/cpu:1"], cross_device_ops=kd.NcclAllReduce())
    >>> float(strategy.reduce("SUM", strategy.run(lambda: 1.0), axis=None))
    2.0
    """

    def __init__(self, num_packs: int = 1):
        super().__init__()
        _check_num_packs(num_packs)
        self.num_packs = num_packs

    # Gradients up to this size share one packed buffer; larger ones are their
    # own operands of the same psum (one collective after XLA's combiner).
    _max_packed_elements = 1 << 12

    def _reduce_operands(self, operands, num_replicas):
        return list(lax.psum(list(operands), AXIS))


class HierarchicalCopyAllReduce(CrossDeviceOps):
    """Reduce-scatter followed by all-gather, over ``num_packs`` buffers.

    >>> import keras_dist as kd
    >>> ops = kd.HierarchicalCopyAllReduce(num_packs=2)
    >>> ops.num_packs
    2
    """

    def __init__(self, num_packs: int = 1):
        super().__init__()
        _check_num_packs(num_packs)
        self.num_packs = max(num_packs, 1)

    def _reduce_buffer(self, buffer, num_replicas):
        size = buffer.shape[0]
        chunks = np.array_split(np.arange(size), min(self.num_packs, max(size, 1)))
        out = []
        for chunk in chunks:
            if chunk.size == 0:
                continue
            part = buffer[int(chunk[0]) : int(chunk[-1]) + 1]
            padding = (-part.shape[0]) % num_replicas
            padded = jnp.pad(part, (0, padding))
            scattered = lax.psum_scatter(padded, AXIS, scatter_dimension=0, tiled=True)
            gathered = lax.all_gather(scattered, AXIS, axis=0, tiled=True)
            out.append(gathered[: part.shape[0]])
        if not out:
            return buffer
        return out[0] if len(out) == 1 else jnp.concatenate(out)


def _check_num_packs(num_packs) -> None:
    if isinstance(num_packs, bool) or not isinstance(num_packs, numbers.Integral):
        raise TypeError(
            "`num_packs` must be an integer: how many buffers the gradients are packed "
            f"into, e.g. num_packs=1. Received: num_packs={num_packs!r}"
        )
    if num_packs < 0:
        raise ValueError(f"`num_packs` must be at least 0. Received: num_packs={num_packs}")


def _add_n(values):
    return functools.reduce(lambda a, b: a + b, values)


def _destination_devices(destinations) -> list:
    """The devices ``destinations`` names: a device or its name, a list of them, or a
    distributed value (its components' devices)."""
    if isinstance(destinations, (str, jax.Device)):
        return [resolve_device(destinations, "destinations")]
    if isinstance(destinations, DistributedValues):
        return [_device_of(c) for c in destinations.values]
    if isinstance(destinations, (list, tuple)) and destinations:
        return [resolve_device(d, "destinations") for d in destinations]
    raise ValueError(
        "Outside a strategy's scope, `destinations` must name the devices to reduce or "
        "broadcast to: a device string such as '/cpu:0', a list of them, or a distributed "
        f"value. Received: destinations={destinations!r}"
    )


def _device_of(component) -> jax.Device:
    devices = jnp.asarray(component).devices()
    return next(iter(devices)) if len(devices) == 1 else jax.devices()[0]


def _place_unscoped(value, destinations):
    """``value`` on ``destinations``: an array on one device, or a ``Mirrored`` of copies."""
    devices = _destination_devices(destinations)
    copies = tuple(jax.device_put(value, device) for device in devices)
    if len(copies) == 1 and not isinstance(destinations, (list, tuple, DistributedValues)):
        return copies[0]
    return Mirrored(copies)


def _reduce_unscoped(add, reduce_op, value, destinations):
    """``CrossDeviceOps.reduce`` outside any strategy: TF's ops work on their own."""
    components = value.values if isinstance(value, DistributedValues) else (value,)
    target = _destination_devices(destinations)[0]
    total = add([jax.device_put(jnp.asarray(c), target) for c in components])
    if reduce_op is ReduceOp.MEAN:
        total = mean_of(total, len(components))
    return _place_unscoped(total, destinations)


class ReductionToOneDevice(CrossDeviceOps):
    """Brings every component to one device, adds them, and broadcasts the sum.

    Args:
        reduce_to_device: where the cross-replica reduction runs (default: the
            first destination device).
        accumulation_fn: adds a list of tensors (default: like ``tf.math.add_n``).

    >>> import keras_dist as kd
    >>> ops = kd.ReductionToOneDevice(reduce_to_device="/cpu:0")
    >>> ops.reduce_to_device
    '/cpu:0'
    """

    def __init__(self, reduce_to_device=None, accumulation_fn=None):
        super().__init__()
        if reduce_to_device is not None:
            check_device_name(reduce_to_device, "reduce_to_device")
        if accumulation_fn is not None and not callable(accumulation_fn):
            raise TypeError(
                "`accumulation_fn` must be a function that adds a list of arrays, such as "
                f"tf.math.add_n. Received: accumulation_fn={accumulation_fn!r}"
            )
        self.reduce_to_device = reduce_to_device
        self.accumulation_fn = accumulation_fn or _add_n

    def check_devices(self) -> None:
        """``reduce_to_device`` must be a device of this host.

        >>> import keras_dist as kd
        >>> kd.MirroredStrategy(["/cpu:0"], kd.ReductionToOneDevice("/cpu:99"))
        ... # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        ValueError: Device '/cpu:99' does not exist on this host. Available devices: [...].
        Received: reduce_to_device='/cpu:99'
        """
        if self.reduce_to_device is not None:
            resolve_device(self.reduce_to_device, "reduce_to_device")

    def _add_components(self, components):
        return self.accumulation_fn(components)

    def _reduce_buffer(self, buffer, num_replicas):
        gathered = lax.all_gather(buffer, AXIS, axis=0)
        return self.accumulation_fn([gathered[i] for i in range(num_replicas)])

    def reduce_components(self, placement, reduce_op, stacked_leaves, true_mean=False):
        target = (
            resolve_device(self.reduce_to_device)
            if self.reduce_to_device is not None
            else placement.local_devices[0]
        )
        n = placement.num_local_replicas
        out = []
        for stacked in stacked_leaves:
            parts = [jax.device_put(c, target) for c in unstack(stacked)]
            total = self.accumulation_fn(parts)
            if reduce_op is ReduceOp.MEAN:
                total = mean_of(total, n, not true_mean)
            out.append(jax.device_put(total, placement.replicated))
        return out


def select_cross_device_ops(devices) -> CrossDeviceOps:
    """The default: one fused all-reduce, the fastest path on every JAX backend."""
    return NcclAllReduce()
