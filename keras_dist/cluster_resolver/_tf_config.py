"""``TFConfigClusterResolver``: the cluster described by TF's ``TF_CONFIG`` variable."""

import json
import os

from keras_dist.cluster_resolver._base import ClusterResolver
from keras_dist.cluster_resolver._base import format_master_url
from keras_dist.cluster_resolver._cluster_spec import ClusterSpec


class TFConfigClusterResolver(ClusterResolver):
    """Reads the cluster from the ``TF_CONFIG`` environment variable, as TF does.

    ``TF_CONFIG`` is JSON with ``cluster``, ``task`` (``type``, ``index``) and
    optionally ``rpc_layer``, ``session_master`` and ``environment``; it is
    read at every call. Arguments given here override its ``task`` and
    ``rpc_layer``. ``environ`` replaces ``os.environ`` (for tests).

    >>> config = {"cluster": {"worker": ["w0:2222", "w1:2222"]},
    ...           "task": {"type": "worker", "index": "1"}}
    >>> resolver = TFConfigClusterResolver(environ={"TF_CONFIG": json.dumps(config)})
    >>> resolver.task_type, resolver.task_id, resolver.master()
    ('worker', 1, 'w1:2222')
    >>> TFConfigClusterResolver(environ={}).master()
    ''
    """

    def __init__(
        self, task_type=None, task_id=None, rpc_layer=None, environment=None, *, environ=None
    ):
        self._task_type = task_type
        self._task_id = task_id
        self._rpc_layer = rpc_layer
        self._environment = environment
        self._environ = environ

    def _tf_config(self):
        environ = os.environ if self._environ is None else self._environ
        # Unset TF_CONFIG means "{}"; bad JSON raises json.JSONDecodeError as in TF.
        return json.loads(environ.get("TF_CONFIG", "{}"))

    @property
    def task_type(self):
        """This task's job: the constructor's, else ``TF_CONFIG["task"]["type"]`` as a str."""
        if self._task_type is not None:
            return str(self._task_type)
        task = self._tf_config().get("task", {})
        return str(task["type"]) if "type" in task else None

    @task_type.setter
    def task_type(self, task_type):
        self._task_type = task_type

    @property
    def task_id(self):
        """This task's index: the constructor's, else ``TF_CONFIG["task"]["index"]`` as an int."""
        if self._task_id is not None:
            return int(self._task_id)
        task = self._tf_config().get("task", {})
        return int(task["index"]) if "index" in task else None

    @task_id.setter
    def task_id(self, task_id):
        self._task_id = task_id

    @property
    def rpc_layer(self):
        """The RPC layer: the constructor's, else ``TF_CONFIG["rpc_layer"]`` (or ``None``)."""
        if self._rpc_layer is not None:
            return self._rpc_layer
        return self._tf_config().get("rpc_layer")

    @rpc_layer.setter
    def rpc_layer(self, rpc_layer):
        self._rpc_layer = rpc_layer

    @property
    def environment(self):
        """The constructor's ``environment``, else ``TF_CONFIG["environment"]`` (or ``None``)."""
        if self._environment is not None:
            return self._environment
        return self._tf_config().get("environment")

    def cluster_spec(self):
        """``TF_CONFIG["cluster"]`` as a ``ClusterSpec``; empty when there is none."""
        return ClusterSpec(self._tf_config().get("cluster", {}))

    def master(self, task_type=None, task_id=None, rpc_layer=None):
        """``session_master`` if set, ``""`` for 0 or 1 task, else the task's address."""
        session_master = self._tf_config().get("session_master")
        if session_master is not None:
            return session_master
        spec = self.cluster_spec()
        # One task alone needs no master: TF then runs in-process.
        if not spec.jobs or (len(spec.jobs) == 1 and len(spec.job_tasks(spec.jobs[0])) == 1):
            return ""
        task_type = self.task_type if task_type is None else task_type
        task_id = self.task_id if task_id is None else task_id
        rpc_layer = self.rpc_layer if rpc_layer is None else rpc_layer
        return format_master_url(spec.task_address(task_type, task_id), rpc_layer)

    def num_accelerators(self, task_type=None, task_id=None, config_proto=None):
        """Accelerators of a task, by default the ``TF_CONFIG`` task."""
        task_type = self.task_type if task_type is None else task_type
        task_id = self.task_id if task_id is None else task_id
        return super().num_accelerators(task_type, task_id, config_proto)
