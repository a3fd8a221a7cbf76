"""``TPUClusterResolver``: the TPU cores a ``TPUStrategy`` runs on.

JAX runs TPUs from the TPU VM that hosts them, so the resolver finds the
local TPU devices (``tpu=None``, ``""`` or ``"local"``). On a multi-host
slice it first starts ``jax.distributed`` with no arguments, which detects the
slice from the TPU environment. ``tpu="simulated"`` is a keras_dist addition
for tests: the local CPU devices stand in for TPU cores, and everything after
device discovery runs the same code as on a TPU.

TF also connects to remote TPU nodes by name or ``grpc://`` address; JAX has no
such runtime, and the resolver says so.
"""

import os

import jax

from keras_dist import _distributed_runtime
from keras_dist.cluster_resolver._base import ClusterResolver
from keras_dist.cluster_resolver._cluster_spec import ClusterSpec

_LOCAL_NAMES = (None, "", "local")
SIMULATED = "simulated"
# Cloud TPU VMs name every host of a slice here (comma-separated).
_HOSTNAMES_ENV = "TPU_WORKER_HOSTNAMES"


def _available_platforms() -> str:
    platforms = sorted({d.platform for d in jax.devices()})
    return ", ".join(platforms) or "none"


def _start_multi_host_runtime() -> None:
    """Starts ``jax.distributed`` on a multi-host slice (JAX detects its layout).

    Nothing to do on one host, or when it already runs.
    """
    hosts = [h for h in os.environ.get(_HOSTNAMES_ENV, "").split(",") if h.strip()]
    if len(hosts) > 1 and not _distributed_runtime.is_initialized():
        jax.distributed.initialize()


def _local_tpu_devices(tpu) -> tuple:
    _start_multi_host_runtime()
    try:
        devices = tuple(jax.devices("tpu"))
    except RuntimeError:
        devices = ()
    if not devices:
        raise ValueError(
            f"TPUClusterResolver(tpu={tpu!r}) found no TPU devices on this machine. It "
            "looked for JAX's 'tpu' backend (`jax.devices('tpu')`); JAX has these "
            f"platforms: {_available_platforms()}. Run the program on a Cloud TPU VM "
            'with `pip install "jax[tpu]"`, or pass tpu="simulated" to run TPU code on '
            f"this machine's CPU devices (a testing aid). Received: tpu={tpu!r}"
        )
    return devices


class TPUClusterResolver(ClusterResolver):
    """The TPU cores of this TPU VM (or slice), for ``TPUStrategy``.

    Args:
        tpu: ``None``, ``""`` or ``"local"`` for this machine's TPU devices;
            ``"simulated"`` (a keras_dist addition, for tests) for its CPU
            devices standing in for TPU cores. A TPU name or ``grpc://``
            address (a remote TPU node) is not supported under JAX.

    TF's arguments for finding a remote TPU node (``zone``, ``project``, ``job_name``,
    ``coordinator_name``, ``coordinator_address``, ``credentials``, ``service``,
    ``discovery_url``) are accepted so that TF code runs, and unused.

    Without TPUs, ``tpu="local"`` raises ``ValueError`` naming what it looked for.

    >>> resolver = TPUClusterResolver(tpu="simulated")
    >>> resolver.num_accelerators()["TPU"] == len(jax.devices("cpu"))
    True
    >>> resolver.master(), resolver.get_job_name(), resolver.cluster_spec().as_dict()
    ('', 'worker', {})
    """

    def __init__(
        self,
        tpu=None,
        zone=None,
        project=None,
        job_name="worker",
        coordinator_name=None,
        coordinator_address=None,
        credentials="default",
        service=None,
        discovery_url=None,
    ):
        del zone, project, coordinator_name, coordinator_address  # a remote node's
        del credentials, service, discovery_url
        if isinstance(tpu, bytes):
            tpu = tpu.decode()
        if tpu == SIMULATED:
            devices = tuple(jax.devices("cpu"))
        elif tpu in _LOCAL_NAMES:
            devices = _local_tpu_devices(tpu)
        else:
            raise ValueError(
                "keras_dist runs TPUs through JAX on the TPU VM itself: run the program "
                "on the TPU VM and pass tpu='local' (or None). Connecting to a remote TPU "
                "node by name or grpc:// address is a TensorFlow runtime feature that "
                "JAX does not have. For tests without TPUs pass tpu='simulated'. "
                f"Received: tpu={tpu!r}"
            )
        self._tpu = tpu
        self._devices = devices
        self._job_name = job_name
        self.task_type = job_name
        self.task_id = jax.process_index()

    @classmethod
    def connect(cls, tpu=None, zone=None, project=None):
        """Finds the TPU (``TPUClusterResolver(tpu, zone, project)``) and returns it.

        TF also connects the runtime to a remote TPU and initializes it; under
        JAX the TPU system starts with the first computation, so there is
        nothing more to do.
        """
        return cls(tpu, zone, project)

    @property
    def simulated(self) -> bool:
        """Whether CPU devices stand in for TPU cores (``tpu="simulated"``)."""
        return self._tpu == SIMULATED

    @property
    def tpu_devices(self) -> tuple:
        """The ``jax.Device`` objects used as TPU cores, every process's, in JAX's order."""
        return self._devices

    def local_tpu_devices(self) -> tuple:
        """This process's TPU cores (``tpu_devices`` of this host)."""
        index = jax.process_index()
        return tuple(d for d in self._devices if d.process_index == index)

    def get_job_name(self) -> str:
        """The job name of the TPU hosts (``"worker"`` unless given)."""
        return self._job_name

    def master(self, task_type=None, task_id=None, rpc_layer=None):
        """``""``: a local TPU has no master address (as TF's resolver for a TPU VM)."""
        if task_type is not None and task_id is not None:
            return self.task_master(task_type, task_id, rpc_layer or self.rpc_layer)
        return ""

    def get_master(self):
        """``master()``."""
        return self.master()

    def cluster_spec(self):
        """Empty on one host; on a slice, one task per host of ``TPU_WORKER_HOSTNAMES``."""
        hosts = [h.strip() for h in os.environ.get(_HOSTNAMES_ENV, "").split(",") if h.strip()]
        if jax.process_count() == 1 or len(hosts) != jax.process_count():
            return ClusterSpec({})
        return ClusterSpec({self._job_name: [f"{host}:8470" for host in hosts]})

    def num_accelerators(self, task_type=None, task_id=None, config_proto=None):
        """``{"TPU": n}``, ``n`` the TPU cores of one host (TF counts a task's cores)."""
        del task_type, task_id, config_proto  # every host of a slice has as many
        return {"TPU": len(self.local_tpu_devices())}

    def __repr__(self):
        return f"TPUClusterResolver(tpu={self._tpu!r}, cores={len(self._devices)})"
