"""``GCEClusterResolver``: the cluster made of the running instances of a GCE instance group.

As in TF, the Compute Engine API lists the group's running instances and gives
each one's internal IP, at every ``cluster_spec()`` call. The Google API client
is optional (``pip install "keras_dist[gce]"``); any object shaped like its
``compute`` service (``instanceGroups()`` and ``instances()``) can stand in.
"""

from keras_dist.cluster_resolver._base import ClusterResolver
from keras_dist.cluster_resolver._cluster_spec import ClusterSpec


def _compute_service(credentials):
    """The Compute Engine v1 service of ``googleapiclient``."""
    try:
        # Optional and heavy (google-api-python-client and its auth stack): imported
        # only when no `service` is given.
        from googleapiclient import discovery
    except ImportError as error:
        raise ImportError(
            "GCEClusterResolver needs the Google API client, which is not installed. "
            'Install it with `pip install "keras_dist[gce]"` (or `pip install '
            "google-api-python-client`), or pass `service=` an object shaped like "
            "`googleapiclient.discovery.build('compute', 'v1')`. Received: service=None"
        ) from error
    # None makes the client find the application default credentials, which TF
    # loaded through oauth2client (now retired) for "default".
    if credentials == "default":
        credentials = None
    return discovery.build("compute", "v1", credentials=credentials)


class GCEClusterResolver(ClusterResolver):
    """The cluster of the running instances of a GCE instance group (TF's).

    Every instance is a task of job ``task_type``; its address is the internal
    IP of its first network interface and ``port``. As in TF the addresses are
    sorted as strings, so a task id follows its address, not the instance
    name. The group is listed anew, page by page, at every call.

    ``task_type`` is fixed at construction (setting it raises
    ``RuntimeError``, as in TF); ``task_id`` and ``rpc_layer`` may be set later.
    ``service`` replaces ``googleapiclient.discovery.build("compute", "v1")``
    (then ``credentials`` is unused).

    >>> class Request:
    ...     def __init__(self, response):
    ...         self.response = response
    ...     def execute(self):
    ...         return self.response
    >>> class InstanceGroups:
    ...     def listInstances(self, project, zone, instanceGroup, body, orderBy):
    ...         return Request({"items": [
    ...             {"instance": f"zones/{zone}/instances/{name}", "status": "RUNNING"}
    ...             for name in ("vm-1", "vm-2")]})
    ...     def listInstances_next(self, previous_request, previous_response):
    ...         return None  # one page
    >>> class Instances:
    ...     def get(self, project, zone, instance):
    ...         ip = {"vm-1": "10.0.0.7", "vm-2": "10.0.0.3"}[instance]
    ...         return Request({"networkInterfaces": [{"networkIP": ip}]})
    >>> class FakeCompute:
    ...     def instanceGroups(self):
    ...         return InstanceGroups()
    ...     def instances(self):
    ...         return Instances()
    >>> resolver = GCEClusterResolver(
    ...     "my-project", "us-east1-d", "trainers", port=8470, task_id=1, service=FakeCompute())
    >>> resolver.cluster_spec().as_dict()
    {'worker': ['10.0.0.3:8470', '10.0.0.7:8470']}
    >>> resolver.master()
    'grpc://10.0.0.7:8470'
    """

    def __init__(
        self,
        project: str,
        zone: str,
        instance_group: str,
        port: int,
        task_type: str = "worker",
        task_id: int = 0,
        rpc_layer: str | None = "grpc",
        credentials="default",
        service=None,
    ):
        self._project = project
        self._zone = zone
        self._instance_group = instance_group
        self._port = port
        self._task_type = task_type
        self._task_id = task_id
        self._rpc_layer = rpc_layer
        if service is None:
            service = _compute_service(credentials)
        self._service = service

    @property
    def task_type(self):
        """The job of every instance of the group, given to the constructor."""
        return self._task_type

    @task_type.setter
    def task_type(self, task_type):
        raise RuntimeError(
            "You cannot reset the task_type of the GCEClusterResolver after it has been "
            "created. Pass task_type= to the constructor instead. "
            f"Received: task_type={task_type!r}"
        )

    @property
    def task_id(self):
        """This instance's index in the sorted addresses (may be set)."""
        return self._task_id

    @task_id.setter
    def task_id(self, task_id):
        self._task_id = task_id

    @property
    def rpc_layer(self):
        """The RPC layer of ``master()`` addresses (may be set)."""
        return self._rpc_layer

    @rpc_layer.setter
    def rpc_layer(self, rpc_layer):
        self._rpc_layer = rpc_layer

    def _instance_ip(self, name):
        request = self._service.instances().get(
            project=self._project, zone=self._zone, instance=name
        )
        return request.execute()["networkInterfaces"][0]["networkIP"]

    def cluster_spec(self) -> ClusterSpec:
        """Asks the Compute API for the group's running instances, as a ``ClusterSpec``."""
        groups = self._service.instanceGroups()
        request = groups.listInstances(
            project=self._project,
            zone=self._zone,
            instanceGroup=self._instance_group,
            body={"instanceState": "RUNNING"},
            orderBy="name",
        )
        addresses = []
        while request is not None:
            response = request.execute()
            # The API leaves out "items" when a page (or the group) is empty.
            for item in response.get("items", []):
                # The request asks for RUNNING ones; an instance may stop in between.
                if item.get("status", "RUNNING") != "RUNNING":
                    continue
                name = item["instance"].rsplit("/", 1)[-1]
                addresses.append(f"{self._instance_ip(name)}:{self._port}")
            request = groups.listInstances_next(
                previous_request=request, previous_response=response
            )
        addresses.sort()
        return ClusterSpec({self._task_type: addresses})

    def master(self, task_type=None, task_id=None, rpc_layer=None) -> str:
        """``rpc_layer://ip:port`` of a task, by default this one."""
        task_type = self._task_type if task_type is None else task_type
        task_id = self._task_id if task_id is None else task_id
        return self.task_master(task_type, task_id, rpc_layer or self._rpc_layer)
