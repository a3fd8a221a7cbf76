"""``initialize_tpu_system`` and ``shutdown_tpu_system`` (``tf.tpu.experimental``).

TF starts and resets the TPU runtime here. JAX starts it with the first
computation, so initializing finds the resolver's cores and returns their
``Topology``; shutting down forgets it and drops JAX's compiled programs.
Arrays still alive are left alone: JAX frees device memory when they go.
"""

import threading

import jax

from keras_dist.cluster_resolver._tpu_resolver import TPUClusterResolver
from keras_dist.tpu._topology import Topology


class _TPUSystems:
    """The topologies initialized in this process, by resolver (TF keeps the same)."""

    def __init__(self):
        self._lock = threading.Lock()
        self._topologies: dict = {}

    def initialize(self, resolver) -> Topology:
        with self._lock:
            topology = Topology.from_devices(resolver.tpu_devices)
            self._topologies[id(resolver)] = topology
            return topology

    def shutdown(self, resolver) -> None:
        with self._lock:
            if resolver is None:
                self._topologies.clear()
            else:
                self._topologies.pop(id(resolver), None)

    def initialized(self) -> int:
        with self._lock:
            return len(self._topologies)


SYSTEMS = _TPUSystems()


def _checked(cluster_resolver, function):
    if cluster_resolver is None:
        return TPUClusterResolver("")
    if not isinstance(cluster_resolver, TPUClusterResolver):
        raise TypeError(
            f"`{function}` needs a kd.cluster_resolver.TPUClusterResolver, e.g. "
            "TPUClusterResolver(tpu='local') (or tpu='simulated' for tests). Received: "
            f"cluster_resolver={cluster_resolver!r}"
        )
    return cluster_resolver


def initialize_tpu_system(cluster_resolver=None) -> Topology:
    """Finds the TPU system's cores and returns its ``Topology``.

    ``cluster_resolver`` defaults to ``TPUClusterResolver("")`` (this machine's
    TPUs). Call it before building a ``DeviceAssignment``; ``TPUStrategy``
    also works without it.

    >>> import keras_dist as kd
    >>> resolver = kd.cluster_resolver.TPUClusterResolver(tpu="simulated")
    >>> topology = initialize_tpu_system(resolver)
    >>> topology.num_tasks, topology.mesh_shape.tolist()[1:]
    (1, [1, 1, 1])
    """
    resolver = _checked(cluster_resolver, "initialize_tpu_system")
    return SYSTEMS.initialize(resolver)


def shutdown_tpu_system(cluster_resolver=None) -> None:
    """Shuts the TPU system down: forgets its topology and drops compiled programs.

    ``None`` shuts every initialized system down.

    >>> import keras_dist as kd
    >>> resolver = kd.cluster_resolver.TPUClusterResolver(tpu="simulated")
    >>> _ = initialize_tpu_system(resolver)
    >>> shutdown_tpu_system(resolver)
    """
    if cluster_resolver is not None:
        _checked(cluster_resolver, "shutdown_tpu_system")
    SYSTEMS.shutdown(cluster_resolver)
    jax.clear_caches()
