"""`TPUStrategy`: synchronous replicas on TPU cores, with logical devices.

The same engine, variables, ``fit`` and input pipeline as ``MirroredStrategy``
(``MeshExtended``), over the cores a ``TPUClusterResolver`` finds. A device
assignment with several cores per replica gives the mesh's ``logical`` axis
its size: the cores one replica spans, which the logical-device calls split
tensors over (``_logical_devices``).
"""

import jax

from keras_dist.cluster_resolver._tpu_resolver import TPUClusterResolver
from keras_dist.strategies._logical_devices import LogicalDevices
from keras_dist.strategies._logical_devices import assigned_devices
from keras_dist.strategies._mesh_extended import MeshExtended
from keras_dist.strategies._strategy import Strategy
from keras_dist.tpu._device_assignment import DeviceAssignment
from keras_dist.tpu._topology import Topology


class TPUExtended(MeshExtended):
    """``MeshExtended`` over a device assignment's cores; inputs have static shapes."""

    def __init__(self, container_strategy, resolver, assignment):
        mesh_devices, local = assigned_devices(assignment)
        super().__init__(
            container_strategy,
            local,
            mesh_devices=None if local == mesh_devices else mesh_devices,
            cores_per_replica=assignment.num_cores_per_replica,
        )
        self.tpu_cluster_resolver = resolver
        self.device_assignment = assignment

    @property
    def experimental_require_static_shapes(self) -> bool:
        """``True``: TPU programs are compiled for fixed shapes (as in TF)."""
        return True

    @property
    def num_workers(self) -> int:
        return jax.process_count() if self.spans_processes else 1

    @property
    def worker_index(self) -> int:
        return jax.process_index() if self.spans_processes else 0


class TPUStrategy(Strategy):
    """Synchronous training on TPU cores (``tf.distribute.TPUStrategy``).

    Each variable is mirrored on every core; each replica runs its share of the
    global batch and gradients are summed with one all-reduce, as in
    ``MirroredStrategy`` (the same engine, ``fit`` and input pipeline). Replica
    programs are compiled for each input signature; ``steps_per_execution``
    in ``compile`` sets how many batches ``fit`` takes per call.

    Args:
        tpu_cluster_resolver: a ``TPUClusterResolver``; defaults to
            ``TPUClusterResolver("")``, this machine's TPUs.
            ``TPUClusterResolver(tpu="simulated")`` runs on CPU devices.
        experimental_device_assignment: a
            ``kd.tpu.experimental.DeviceAssignment``; one core per replica on
            every core by default. With ``num_cores_per_replica > 1`` a
            replica spans that many cores (its logical devices).
        experimental_spmd_xla_partitioning: TF's switch to SPMD partitioning.
            JAX programs are always SPMD; as in TF, ``True`` refuses
            ``experimental_assign_to_logical_device``.

    >>> import keras_dist as kd
    >>> resolver = kd.cluster_resolver.TPUClusterResolver(tpu="simulated")
    >>> topology = kd.tpu.experimental.initialize_tpu_system(resolver)
    >>> assignment = kd.tpu.experimental.DeviceAssignment.build(
    ...     topology, computation_shape=[2, 1, 1, 1], num_replicas=2)
    >>> strategy = kd.TPUStrategy(resolver, experimental_device_assignment=assignment)
    >>> strategy.num_replicas_in_sync
    2
    """

    def __init__(
        self,
        tpu_cluster_resolver=None,
        experimental_device_assignment=None,
        experimental_spmd_xla_partitioning=False,
    ):
        resolver = tpu_cluster_resolver
        if resolver is None:
            resolver = TPUClusterResolver("")
        if not isinstance(resolver, TPUClusterResolver):
            raise TypeError(
                "`tpu_cluster_resolver` must be a kd.cluster_resolver.TPUClusterResolver "
                "(tpu='local' on a TPU VM, tpu='simulated' for tests). Received: "
                f"tpu_cluster_resolver={resolver!r}"
            )
        assignment = experimental_device_assignment
        if assignment is None:
            # One core a replica, host by host in JAX's device order: each process's
            # replicas are then consecutive, as the mesh's rows of a global array need.
            topology = Topology.from_devices(resolver.tpu_devices)
            cores = topology.device_coordinates.reshape(-1, 1, topology.mesh_rank)
            assignment = DeviceAssignment(topology, cores)
        super().__init__(TPUExtended(self, resolver, assignment))
        self._logical = LogicalDevices(
            self, assignment.num_cores_per_replica, bool(experimental_spmd_xla_partitioning)
        )

    @property
    def cluster_resolver(self):
        """The ``TPUClusterResolver`` the strategy was built from."""
        return self._extended.tpu_cluster_resolver

    def experimental_split_to_logical_devices(self, tensor, partition_dimensions):
        """Splits ``tensor`` across the replica's logical devices. Call in a replica.

        ``partition_dimensions`` has one entry per dimension of ``tensor``: how
        many pieces to cut it into. Their product must be
        ``num_cores_per_replica``; keras_dist splits one dimension (e.g.
        ``[1, 2]`` splits a kernel's columns over 2 cores). The result has the
        same values; XLA computes on the pieces.
        """
        return self._logical.split(tensor, partition_dimensions)

    def experimental_replicate_to_logical_devices(self, tensor):
        """Keeps ``tensor`` whole on every logical device of the replica. Call in a replica."""
        return self._logical.replicate(tensor)

    def experimental_assign_to_logical_device(self, tensor, logical_device_id):
        """Assigns ``tensor`` to one logical device (TF); kept whole here. Call in a replica.

        JAX's SPMD programs cannot pin a value to one core of a replica, so the
        tensor is kept whole on the replica's cores, which gives the same
        numbers. The id is checked as TF checks it.
        """
        return self._logical.assign(tensor, logical_device_id)
