"""``KubernetesClusterResolver``: the cluster made of the pods that match label selectors.

As in TF, each job lists the pods of one or more label selectors through the
Kubernetes API, at every ``cluster_spec()`` call. The official ``kubernetes``
client is optional (``pip install "keras_dist[kubernetes]"``); any object with
its ``list_pod_for_all_namespaces`` method can stand in for it.
"""

import enum

from keras_dist.cluster_resolver._base import ClusterResolver
from keras_dist.cluster_resolver._cluster_spec import ClusterSpec

_DEFAULT_JOB_TO_LABEL_MAPPING = {"worker": ["job-name=tensorflow"]}


class KubernetesExecutableLocation(enum.Enum):
    """Where the program runs, which decides how the client finds the API server.

    * ``WITHIN_CLUSTER``: in a pod of the cluster (the pod's service account).
    * ``OFF_CLUSTER``: anywhere else (``~/.kube/config``).

    >>> KubernetesExecutableLocation.OFF_CLUSTER.value
    1
    """

    WITHIN_CLUSTER = 0
    OFF_CLUSTER = 1


def _core_v1_api(executable_location):
    """The official client's ``CoreV1Api``, configured for ``executable_location``."""
    try:
        # Optional and heavy (it pulls in urllib3, pydantic, aiohttp...): imported only
        # when no `override_client` is given.
        from kubernetes import client
        from kubernetes import config
    except ImportError as error:
        raise ImportError(
            "KubernetesClusterResolver needs the Kubernetes Python client, which is not "
            'installed. Install it with `pip install "keras_dist[kubernetes]"` (or '
            "`pip install kubernetes`), or pass `override_client=` an object with a "
            "`list_pod_for_all_namespaces(label_selector=...)` method. "
            "Received: override_client=None"
        ) from error
    if executable_location is KubernetesExecutableLocation.OFF_CLUSTER:
        config.load_kube_config()
    else:
        config.load_incluster_config()
    return client.CoreV1Api()


class KubernetesClusterResolver(ClusterResolver):
    """The cluster of the running pods that match each job's label selectors (TF's).

    ``job_to_label_mapping`` maps each job to a list of label selectors
    (default ``{"worker": ["job-name=tensorflow"]}``). A job's tasks are the
    pods of its first selector sorted by pod name, then those of the next
    selector, and so on; each task's address is the pod's ``status.host_ip``
    (as in TF: the node's IP, so the pods serve on a ``hostPort`` or the host
    network) and ``tf_server_port``. A pod that is not ``Running`` raises
    ``RuntimeError``, as in TF. The pods are listed anew at every call.

    The resolver cannot tell which pod this process is: set ``task_type`` and
    ``task_id`` before handing it to ``kd.MultiWorkerMirroredStrategy``.

    ``override_client`` replaces the client's ``CoreV1Api`` (then its
    credentials are yours to load); without it the ``kubernetes`` package is
    imported and configured for ``executable_location``.

    >>> from types import SimpleNamespace as Obj
    >>> def pod(name, host_ip):
    ...     return Obj(metadata=Obj(name=name), status=Obj(phase="Running", host_ip=host_ip))
    >>> class FakeCoreV1Api:
    ...     def list_pod_for_all_namespaces(self, label_selector):
    ...         return Obj(items=[pod("trainer-b", "10.0.0.2"), pod("trainer-a", "10.0.0.1")])
    >>> resolver = KubernetesClusterResolver(override_client=FakeCoreV1Api())
    >>> resolver.cluster_spec().as_dict()
    {'worker': ['10.0.0.1:8470', '10.0.0.2:8470']}
    >>> resolver.task_type, resolver.task_id = "worker", 1
    >>> resolver.master()
    'grpc://10.0.0.2:8470'
    """

    def __init__(
        self,
        job_to_label_mapping: dict | None = None,
        tf_server_port: int = 8470,
        rpc_layer: str | None = "grpc",
        override_client=None,
        executable_location: KubernetesExecutableLocation = (
            KubernetesExecutableLocation.WITHIN_CLUSTER
        ),
    ):
        if not isinstance(executable_location, KubernetesExecutableLocation):
            raise ValueError(
                "executable_location must be a KubernetesExecutableLocation, e.g. "
                "kd.cluster_resolver.KubernetesExecutableLocation.OFF_CLUSTER. "
                f"Received: executable_location={executable_location!r}"
            )
        mapping = dict(job_to_label_mapping or _DEFAULT_JOB_TO_LABEL_MAPPING)
        for job, selectors in mapping.items():
            if isinstance(selectors, str) or not all(isinstance(s, str) for s in selectors):
                raise TypeError(
                    f"The label selectors of job {job!r} must be a list of strings, e.g. "
                    f"['job-name=tensorflow']. Received: {job}={selectors!r}"
                )
        self._job_to_label_mapping = {job: list(s) for job, s in mapping.items()}
        self._tf_server_port = tf_server_port
        if override_client is None:
            override_client = _core_v1_api(executable_location)
        self._client = override_client
        self.task_type = None
        self.task_id = None
        self.rpc_layer = rpc_layer

    def cluster_spec(self) -> ClusterSpec:
        """Asks the API server for the pods of every job, as a ``ClusterSpec``."""
        cluster = {}
        for job, selectors in self._job_to_label_mapping.items():
            addresses = []
            for selector in selectors:
                pods = self._client.list_pod_for_all_namespaces(label_selector=selector).items
                # By name, so that a pod keeps its task id from call to call.
                for pod in sorted(pods, key=lambda pod: pod.metadata.name):
                    if pod.status.phase != "Running":
                        raise RuntimeError(
                            f'Pod "{pod.metadata.name}" is not running; phase: '
                            f'"{pod.status.phase}". Wait until every pod of job {job!r} '
                            "runs, or narrow its label selector. Received: "
                            f"label_selector={selector!r}"
                        )
                    addresses.append(f"{pod.status.host_ip}:{self._tf_server_port}")
            cluster[job] = addresses
        return ClusterSpec(cluster)

    def master(self, task_type=None, task_id=None, rpc_layer=None) -> str:
        """``rpc_layer://host:port`` of a task, by default this one; ``""`` if it is not set."""
        task_type = self.task_type if task_type is None else task_type
        task_id = self.task_id if task_id is None else task_id
        return self.task_master(task_type, task_id, rpc_layer or self.rpc_layer)
