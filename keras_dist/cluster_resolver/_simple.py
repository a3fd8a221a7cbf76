"""``SimpleClusterResolver``: a resolver that returns the cluster it was given."""

from keras_dist.cluster_resolver._base import ClusterResolver
from keras_dist.cluster_resolver._base import format_master_url
from keras_dist.cluster_resolver._cluster_spec import ClusterSpec


class SimpleClusterResolver(ClusterResolver):
    """A resolver that returns what it was given.

    >>> resolver = SimpleClusterResolver(
    ...     ClusterSpec({"worker": ["worker0:2222", "worker1:2222"]}),
    ...     task_type="worker", task_id=1, num_accelerators={"GPU": 8})
    >>> resolver.master("worker", 0, rpc_layer="grpc")
    'grpc://worker0:2222'
    >>> resolver.task_type, resolver.task_id, resolver.num_accelerators()
    ('worker', 1, {'GPU': 8})
    """

    def __init__(
        self,
        cluster_spec,
        master="",
        task_type=None,
        task_id=None,
        environment="",
        num_accelerators=None,
        rpc_layer=None,
    ):
        self._cluster_spec = ClusterSpec(cluster_spec)
        self._master = master
        self.task_type = task_type
        self.task_id = task_id
        self._environment = environment
        self._num_accelerators = dict(num_accelerators or {})
        self.rpc_layer = rpc_layer

    def cluster_spec(self):
        """The ``ClusterSpec`` given to the constructor."""
        return self._cluster_spec

    def master(self, task_type=None, task_id=None, rpc_layer=None):
        """The given master, or the address of ``task_type``/``task_id`` when both are given."""
        if task_type is not None and task_id is not None:
            master = self._cluster_spec.task_address(task_type, task_id)
        else:
            master = self._master
        return format_master_url(master, rpc_layer or self.rpc_layer)

    @property
    def environment(self):
        """The environment given to the constructor."""
        return self._environment

    def num_accelerators(self, task_type=None, task_id=None, config_proto=None):
        """The ``num_accelerators`` given to the constructor, whatever the task."""
        return dict(self._num_accelerators)
