"""Resolvers of JAX-style clusters: a coordinator address, a process count and a process id.

``KubeflowClusterResolver`` reads Kubeflow's JAX variables and
``KerasDistributionClusterResolver`` Keras's ``KERAS_DISTRIBUTION_*`` ones;
both build on ``CoordinatorClusterResolver``, as ``OpenMPIClusterResolver``
(``_openmpi.py``) does.
"""

import os

from keras_dist.cluster_resolver._base import ClusterResolver
from keras_dist.cluster_resolver._base import format_master_url
from keras_dist.cluster_resolver._cluster_spec import ClusterSpec


class CoordinatorClusterResolver(ClusterResolver):
    """A JAX-style cluster: a coordinator address, a process count and this process's id.

    Only the coordinator's address is known; the other workers' addresses are
    empty strings, which is all ``jax.distributed.initialize`` needs.
    """

    def __init__(self, coordinator_address, num_processes, process_id, rpc_layer=None):
        self.coordinator_address = coordinator_address
        self.num_processes = int(num_processes)
        self.process_id = int(process_id)
        self.task_type = "worker"
        self.task_id = self.process_id
        self.rpc_layer = rpc_layer

    def cluster_spec(self):
        """Job ``worker`` with ``num_processes`` tasks, task 0 at the coordinator."""
        return ClusterSpec({"worker": [self.coordinator_address] + [""] * (self.num_processes - 1)})

    def master(self, task_type=None, task_id=None, rpc_layer=None):
        """The coordinator's address (the only one known)."""
        return format_master_url(self.coordinator_address, rpc_layer or self.rpc_layer)


class KubeflowClusterResolver(CoordinatorClusterResolver):
    """The cluster of a Kubeflow JAXJob / Trainer pod, from its JAX environment variables.

    Reads ``COORDINATOR_ADDRESS`` (+ ``COORDINATOR_PORT``), ``NUM_PROCESSES``
    and ``PROCESS_ID``, or ``JAX_COORDINATOR_ADDRESS``, ``JAX_NUM_PROCESSES``
    and ``JAX_PROCESS_ID``. Every process is a ``worker``; its ``task_id`` is
    its process id. ``environ`` replaces ``os.environ``.

    >>> env = {"COORDINATOR_ADDRESS": "trainer-0", "COORDINATOR_PORT": "1234",
    ...        "NUM_PROCESSES": "2", "PROCESS_ID": "1"}
    >>> resolver = KubeflowClusterResolver(environ=env)
    >>> resolver.coordinator_address, resolver.num_processes, resolver.process_id
    ('trainer-0:1234', 2, 1)
    >>> resolver.task_type, resolver.task_id
    ('worker', 1)
    """

    def __init__(self, *, environ=None):
        env = os.environ if environ is None else environ
        if not self.detect(env):
            raise ValueError(
                "Kubeflow's JAX variables are not set: need COORDINATOR_ADDRESS, NUM_PROCESSES "
                "and PROCESS_ID, or their JAX_ forms. Received: "
                f"{ {k: v for k, v in env.items() if k in _KUBEFLOW_VARS}!r}"
            )
        if env.get("COORDINATOR_ADDRESS"):
            address = env["COORDINATOR_ADDRESS"]
            if env.get("COORDINATOR_PORT"):
                address = f"{address}:{env['COORDINATOR_PORT']}"
            num, pid = env["NUM_PROCESSES"], env["PROCESS_ID"]
        else:
            address = env["JAX_COORDINATOR_ADDRESS"]
            num, pid = env["JAX_NUM_PROCESSES"], env["JAX_PROCESS_ID"]
        super().__init__(address, num, pid)

    @staticmethod
    def detect(environ):
        """Whether ``environ`` holds a complete set of Kubeflow's JAX variables."""
        return any(all(environ.get(name) for name in names) for names in _KUBEFLOW_SETS)


_KUBEFLOW_SETS = (
    ("COORDINATOR_ADDRESS", "NUM_PROCESSES", "PROCESS_ID"),
    ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID"),
)
_KUBEFLOW_VARS = {"COORDINATOR_PORT", *(name for names in _KUBEFLOW_SETS for name in names)}
KERAS_VARS = (
    "KERAS_DISTRIBUTION_JOB_ADDRESSES",
    "KERAS_DISTRIBUTION_NUM_PROCESSES",
    "KERAS_DISTRIBUTION_PROCESS_ID",
)


class KerasDistributionClusterResolver(CoordinatorClusterResolver):
    """The cluster given by Keras's ``KERAS_DISTRIBUTION_*`` variables.

    ``KERAS_DISTRIBUTION_JOB_ADDRESSES`` is comma separated (the first is the
    coordinator); ``KERAS_DISTRIBUTION_NUM_PROCESSES`` and
    ``KERAS_DISTRIBUTION_PROCESS_ID`` as in ``keras.distribution.initialize``.

    >>> env = {"KERAS_DISTRIBUTION_JOB_ADDRESSES": "10.0.0.1:1234,10.0.0.2:2345",
    ...        "KERAS_DISTRIBUTION_NUM_PROCESSES": "2", "KERAS_DISTRIBUTION_PROCESS_ID": "0"}
    >>> resolver = KerasDistributionClusterResolver(environ=env)
    >>> resolver.cluster_spec().as_dict(), resolver.task_id
    ({'worker': ['10.0.0.1:1234', '10.0.0.2:2345']}, 0)
    """

    def __init__(self, *, environ=None):
        env = os.environ if environ is None else environ
        missing = [name for name in KERAS_VARS if not env.get(name)]
        if missing:
            raise ValueError(
                f"Keras's distribution variables are not all set. Received: missing={missing}"
            )
        self._addresses = [a.strip() for a in env["KERAS_DISTRIBUTION_JOB_ADDRESSES"].split(",")]
        super().__init__(
            self._addresses[0],
            env["KERAS_DISTRIBUTION_NUM_PROCESSES"],
            env["KERAS_DISTRIBUTION_PROCESS_ID"],
        )

    def cluster_spec(self):
        """Job ``worker``: all addresses when every process has one, else the coordinator only."""
        if len(self._addresses) == self.num_processes:
            return ClusterSpec({"worker": self._addresses})
        return super().cluster_spec()
