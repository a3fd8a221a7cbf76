"""``UnionClusterResolver`` (and its TF alias ``UnionResolver``): merges several clusters."""

from keras_dist.cluster_resolver._base import ClusterResolver
from keras_dist.cluster_resolver._base import format_master_url
from keras_dist.cluster_resolver._cluster_spec import ClusterSpec


class UnionClusterResolver(ClusterResolver):
    """Merges the clusters of several resolvers; the first one gives this task.

    Jobs present in several resolvers are concatenated (lists) or merged
    (sparse dicts; a task index present twice raises ``KeyError``).

    >>> from keras_dist.cluster_resolver import SimpleClusterResolver
    >>> a = SimpleClusterResolver(
    ...     ClusterSpec({"worker": ["w0:1", "w1:1"]}), task_type="worker", task_id=0)
    >>> b = SimpleClusterResolver(ClusterSpec({"worker": ["w2:1"], "ps": ["p0:1"]}))
    >>> union = UnionClusterResolver(a, b)
    >>> union.cluster_spec().as_dict()
    {'worker': ['w0:1', 'w1:1', 'w2:1'], 'ps': ['p0:1']}
    >>> union.task_type, union.task_id
    ('worker', 0)
    """

    def __init__(self, *resolvers, task_type=None, task_id=None, rpc_layer=None):
        if not resolvers:
            raise ValueError(
                "UnionClusterResolver needs at least one ClusterResolver. Received: ()"
            )
        for resolver in resolvers:
            if not isinstance(resolver, ClusterResolver):
                raise TypeError(
                    f"All arguments must be ClusterResolver instances. Received: {resolver!r}"
                )
        self._resolvers = resolvers
        self._task_type = task_type
        self._task_id = task_id
        self._rpc_layer = rpc_layer

    @property
    def task_type(self):
        """The constructor's ``task_type``, else the first resolver's."""
        return self._task_type or self._resolvers[0].task_type

    @task_type.setter
    def task_type(self, task_type):
        self._task_type = task_type

    @property
    def task_id(self):
        """The constructor's ``task_id``, else the first resolver's."""
        return self._task_id if self._task_id is not None else self._resolvers[0].task_id

    @task_id.setter
    def task_id(self, task_id):
        self._task_id = task_id

    @property
    def rpc_layer(self):
        """The constructor's ``rpc_layer``, else the first resolver's."""
        return self._rpc_layer or self._resolvers[0].rpc_layer

    @rpc_layer.setter
    def rpc_layer(self, rpc_layer):
        self._rpc_layer = rpc_layer

    @property
    def environment(self):
        """The first resolver's environment."""
        return self._resolvers[0].environment

    def cluster_spec(self):
        """The union of all resolvers' clusters."""
        dicts = [resolver.cluster_spec().as_dict() for resolver in self._resolvers]
        # A job stays a list only if every resolver gives it as a list.
        sparse = {job for d in dicts for job, tasks in d.items() if isinstance(tasks, dict)}
        merged = {}
        for d in dicts:
            for job, tasks in d.items():
                if job not in sparse:
                    merged.setdefault(job, []).extend(tasks)
                    continue
                tasks = dict(enumerate(tasks)) if isinstance(tasks, list) else tasks
                target = merged.setdefault(job, {})
                duplicates = set(tasks) & set(target)
                if duplicates:
                    raise KeyError(
                        "Duplicate keys detected when merging two ClusterSpecs: "
                        f"{duplicates!r}. Received: job={job!r}"
                    )
                target.update(tasks)
        return ClusterSpec(merged)

    def master(self, task_type=None, task_id=None, rpc_layer=None):
        """The address of ``task_type``/``task_id`` in the union, else the first's master."""
        if task_type is not None and task_id is not None:
            master = self.cluster_spec().task_address(task_type, task_id)
            return format_master_url(master, rpc_layer or self.rpc_layer)
        return self._resolvers[0].master(rpc_layer=rpc_layer)

    def num_accelerators(self, task_type=None, task_id=None, config_proto=None):
        """The first resolver's ``num_accelerators``."""
        return self._resolvers[0].num_accelerators(task_type, task_id, config_proto)


# TF exports the same class under both names (tf.distribute.cluster_resolver.UnionResolver).
UnionResolver = UnionClusterResolver
