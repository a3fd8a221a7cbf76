"""Where a mesh strategy's arrays live, and the primitives that move them.

A ``Placement`` owns the strategy's mesh and the two shardings everything uses
(replicated, and split along ``"replica"``). Across processes a value this
process holds is its rows of a global array; the placement primitives here
never communicate unless their docstring says so, because a collective issued
by one process and not the others would hang them all.

Every multi-device execution goes through ``execute``: the strategy decides
how (on CPU one execution in flight at a time; across processes under a peer
watch with a deadline).
"""

import collections

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from keras_dist._engine._gate import GATE
from keras_dist._engine._gate import needs_serializing
from keras_dist._mesh import REPLICA_AXIS
from keras_dist._mesh import PlacedAlike
from keras_dist._mesh import replica_mesh
from keras_dist._reduce_op import ReduceOp
from keras_dist._values import DistributedValues
from keras_dist._values import unstack


class Placement:
    """The mesh of a strategy's replicas and the primitives that place arrays on it.

    ``local_devices`` are this process's replicas' devices; ``mesh_devices``
    every process's (the same on one host). With ``cores_per_replica=k > 1``
    both list every core, replica by replica (replica ``r`` spans
    ``devices[r * k:(r + 1) * k]``, its logical devices in order), and
    ``local_devices`` keeps each replica's first core: where the replica's
    per-replica values and eager copies live.

    >>> import jax, numpy as np
    >>> placement = Placement(jax.devices()[:2])
    >>> placement.put_local_rows(np.zeros((2, 3))).shape
    (2, 3)
    """

    def __init__(
        self,
        local_devices,
        mesh_devices=None,
        dispatch=None,
        cross_device_ops=None,
        cores_per_replica=1,
    ):
        local_cores = tuple(local_devices)
        mesh_devices = tuple(mesh_devices or local_cores)
        self.spans_processes = mesh_devices != local_cores
        self.mesh = replica_mesh(mesh_devices, cores_per_replica)
        self.cores_per_replica = cores_per_replica
        # Every local replica's cores, and its first core (where its components live).
        self.replica_cores = tuple(
            local_cores[i : i + cores_per_replica]
            for i in range(0, len(local_cores), cores_per_replica)
        )
        self.local_devices = tuple(cores[0] for cores in self.replica_cores)
        # The global id of this process's first replica.
        self.first_local_replica_id = mesh_devices.index(local_cores[0]) // cores_per_replica
        self.num_local_replicas = len(self.local_devices)
        self.num_replicas = len(mesh_devices) // cores_per_replica
        # Workers may hold different numbers of replicas (2 devices here, 4 there).
        per_process = collections.Counter(d.process_index for d in mesh_devices)
        self.same_replicas_per_process = len(set(per_process.values())) == 1
        self.replicated = NamedSharding(self.mesh, P())
        self.split = NamedSharding(self.mesh, P(REPLICA_AXIS))
        self._serialize = needs_serializing(mesh_devices)
        self._placed_alike = PlacedAlike()
        self._dispatch = dispatch
        # Set by the strategy after construction: cross-process sums reduce with it.
        self.cross_device_ops = cross_device_ops

    # --------------------------------------------------------------- running
    @property
    def serializes(self) -> bool:
        """Whether multi-device executions run one at a time here (several CPU devices)."""
        return self._serialize

    def execute(self, fn, *args, may_run_on: bool = False):
        """Runs a multi-device program: where jaxlib needs it, it has ended when this
        returns (a step's program, ``may_run_on``, not always: ``_engine/_gate.py``)."""
        return GATE.call(self._serialize, fn, *args, may_run_on=may_run_on, dispatch=self._dispatch)

    # ------------------------------------------------------------- placement
    def put(self, value, sharding):
        """``value`` (host or local) stored with ``sharding``, without communication.

        On one process this is ``jax.device_put``. Across processes
        ``device_put`` would first check with a collective that every process
        passes the same value; callers here guarantee it (or, for first
        values of variables, replace it with worker 0's afterwards).
        """
        if not self.spans_processes:
            return jax.device_put(value, sharding)
        if isinstance(value, jax.Array) and not value.is_fully_addressable:
            if value.sharding == sharding:
                return value
            return _resharding(sharding)(value)
        host = np.asarray(jnp.asarray(value))
        return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])

    def replicate(self, value):
        """``value`` replicated on every replica's device."""
        if isinstance(value, jax.Array) and value.sharding == self.replicated:
            return value
        return self.put(value, self.replicated)

    def as_argument(self, value):
        """``value`` where a program takes a replicated argument: as it is if already there.

        On one device an array of that device's own is there too, under another
        sharding's name; ``replicate`` would copy it on every call.
        """
        if isinstance(value, jax.Array) and self._placed_alike(value, self.replicated):
            return value
        return self.replicate(value)

    def replicate_all(self, values: list) -> list:
        """``values`` each replicated on every replica's device (one batched transfer)."""
        if self.spans_processes:
            return [self.replicate(v) for v in values]
        return jax.device_put(list(values), self.replicated)

    def put_local_rows_all(self, stacked: list) -> list:
        """``put_local_rows`` of each of ``stacked`` (one batched transfer on one process)."""
        if self.spans_processes:
            return [self.put_local_rows(x) for x in stacked]
        return jax.device_put(list(stacked), self.split)

    def put_local_rows(self, stacked):
        """This process's ``(local_replicas, ...)`` rows as a global stacked array."""
        if not self.spans_processes:
            return jax.device_put(stacked, self.split)
        shape = (self.num_replicas,) + tuple(np.shape(stacked)[1:])
        return jax.make_array_from_process_local_data(self.split, np.asarray(stacked), shape)

    def all_rows(self, stacked):
        """A stacked array with every process's rows, on this process (an all-gather)."""
        if not self.spans_processes:
            return stacked
        return self.execute(self.put, stacked, self.replicated).addressable_data(0)

    def broadcast_stacked(self, value):
        """``(num_replicas, *shape)`` copies of ``value``, split over the replicas."""
        if isinstance(value, jax.Array) and not value.is_fully_addressable:
            value = value.addressable_data(0)
        value = jnp.asarray(value)
        return self.put(jnp.broadcast_to(value, (self.num_replicas,) + value.shape), self.split)

    def stack_components(self, components):
        """One component per local replica, as a stacked global array (no copies)."""
        shapes = {tuple(jnp.shape(c)) for c in components}
        dtypes = {jnp.result_type(c) for c in components}
        if len(shapes) != 1 or len(dtypes) != 1:
            raise ValueError(
                "The per-replica components must have the same shape and dtype to be "
                f"combined on the mesh. Received: shapes={sorted(shapes)}, "
                f"dtypes={sorted(map(str, dtypes))}"
            )
        (shape,) = shapes
        # A replica's component goes to each of its cores (one with one core a replica).
        arrays = [
            jax.device_put(jnp.reshape(jnp.asarray(c), (1,) + shape), d)
            for c, cores in zip(components, self.replica_cores)
            for d in cores
        ]
        global_shape = (self.num_replicas,) + shape
        return jax.make_array_from_single_device_arrays(global_shape, self.split, arrays)

    def as_stacked(self, value: DistributedValues):
        """A distributed value's components as one stacked global array."""
        stacked = value.stacked
        if isinstance(stacked, np.ndarray):
            if self.spans_processes:
                return self.put_local_rows(stacked)
            return stacked  # host batch: the compiled step places it (see _input)
        if stacked is not None and stacked.sharding == self.split:
            return stacked
        stacked = self.stack_components(value.values)
        if all(isinstance(c, jax.Array) for c in jax.tree_util.tree_leaves(value.values)):
            # Immutable components: the next call with this value skips the copies.
            value.cache_stacked(stacked)
        return stacked

    def first_component(self, stacked):
        """Replica 0's component of a stacked array, replicated."""
        return self.replicate(unstack(stacked)[0])

    # ------------------------------------------------- across processes only
    def cross_process_sum(self, tree):
        """Adds a pytree of local arrays over processes (one collective); local results."""
        if not self.spans_processes:
            return tree
        leaves, treedef = jax.tree_util.tree_flatten(tree)
        # This process's total goes in its first replica's row, zeros in the others.
        stacked = []
        for leaf in leaves:
            leaf = np.asarray(leaf)
            rows = np.zeros((self.num_local_replicas,) + leaf.shape, leaf.dtype)
            rows[0] = leaf
            stacked.append(self.put_local_rows(rows))
        summed = self.cross_device_ops.reduce_components(self, ReduceOp.SUM, stacked)
        return jax.tree_util.tree_unflatten(treedef, [s.addressable_data(0) for s in summed])

    def agree_on_host_random_state(self, worker_index: int) -> None:
        """Gives every process worker 0's NumPy global random state (one collective)."""
        if not self.spans_processes:
            return
        name, keys, position, has_gauss, cached = np.random.get_state()
        packed = np.concatenate(
            [
                keys.astype(np.uint32),
                np.array([position, has_gauss], np.uint32),
                np.array([cached], np.float64).view(np.uint32),
            ]
        ).view(np.int32)
        if worker_index != 0:
            packed = np.zeros_like(packed)  # the sum is then worker 0's, bit for bit
        agreed = np.asarray(self.cross_process_sum(packed), np.int32).view(np.uint32)
        cached = float(agreed[-2:].view(np.float64)[0])
        np.random.set_state((name, agreed[: len(keys)], int(agreed[-4]), int(agreed[-3]), cached))

    def from_replica_0(self, mirrored: list, stacked: list):
        """Every replica gets replica 0's values: mirrored arrays and stacked components."""
        return self.execute(_broadcast_from_replica_0(self.mesh), mirrored, stacked)


_RESHARDINGS: dict = {}


def _resharding(sharding):
    """A program that moves a global array to ``sharding`` (an all-gather for replication)."""
    if sharding not in _RESHARDINGS:
        _RESHARDINGS[sharding] = jax.jit(lambda x: x, out_shardings=sharding)
    return _RESHARDINGS[sharding]


_BROADCASTS: dict = {}


def _broadcast_from_replica_0(mesh):
    """A program giving every replica replica 0's mirrored values and components."""
    if mesh not in _BROADCASTS:

        def from_first(x):
            dtype = x.dtype
            if dtype == jnp.bool_:
                x = x.astype(jnp.int8)
            is_first = jax.lax.axis_index(REPLICA_AXIS) == 0
            first = jax.lax.psum(jnp.where(is_first, x, 0), REPLICA_AXIS)
            return first.astype(dtype)

        def body(mirrored, stacked):
            return [from_first(x) for x in mirrored], [from_first(x) for x in stacked]

        _BROADCASTS[mesh] = jax.jit(
            jax.shard_map(
                body,
                mesh=mesh,
                in_specs=(P(), P(REPLICA_AXIS)),
                out_specs=(P(), P(REPLICA_AXIS)),
                check_vma=False,
            )
        )
    return _BROADCASTS[mesh]
