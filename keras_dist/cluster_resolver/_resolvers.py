"""Cluster resolvers: where the tasks of a cluster are and which one this process is.

As in ``tf.distribute.cluster_resolver``: a resolver gives a ``ClusterSpec``,
this task's ``task_type`` and ``task_id``, and the master address. Besides
TF's ``TF_CONFIG``, Slurm, Keras's ``KERAS_DISTRIBUTION_*`` and Kubeflow's JAX
variables are read; ``resolve_cluster`` picks the first that applies.
"""

import abc
import collections
import json
import os
import re

from keras_dist.cluster_resolver._cluster_spec import ClusterSpec


def _format_master_url(master, rpc_layer=None):
    return f"{rpc_layer}://{master}" if rpc_layer else master


_DEVICE_NAME = re.compile(r"/job:([^/]+)/(?:replica:\d+/)?task:(\d+)/device:([^:]+):\d+$")


class ClusterResolver(abc.ABC):
    """Abstract base of cluster resolvers (``tf.distribute.cluster_resolver.ClusterResolver``).

    Subclasses implement ``cluster_spec()`` and ``master()``. ``task_type``,
    ``task_id`` and ``rpc_layer`` may be set after construction.

    >>> class Fixed(ClusterResolver):
    ...     def cluster_spec(self):
    ...         return ClusterSpec({"worker": ["w0:2222"]})
    ...     def master(self, task_type=None, task_id=None, rpc_layer=None):
    ...         return ""
    >>> Fixed().cluster_spec().jobs, Fixed().environment
    (['worker'], '')
    """

    task_type = None
    task_id = None
    rpc_layer = None

    @abc.abstractmethod
    def cluster_spec(self):
        """The ``ClusterSpec`` of the whole cluster."""

    @abc.abstractmethod
    def master(self, task_type=None, task_id=None, rpc_layer=None):
        """The address of a task (this one by default), prefixed by ``rpc_layer://``."""

    @property
    def environment(self):
        """The environment the cluster runs in: ``""`` or, as in TF, ``"google"``."""
        return ""

    def _device_names(self):
        # TF-style names of this process's devices; tests replace this to list a cluster.
        import jax

        job = self.task_type or "localhost"
        task = self.task_id or 0
        return [
            f"/job:{job}/replica:0/task:{task}/device:{d.platform.upper()}:{i}"
            for i, d in enumerate(jax.local_devices())
        ]

    def num_accelerators(self, task_type=None, task_id=None, config_proto=None):
        """Counts accelerators (not CPUs) by type, e.g. ``{"GPU": 2}``.

        With ``task_type`` and ``task_id``, only that task's devices count.
        ``config_proto`` is accepted for TF compatibility and ignored.
        """
        del config_proto  # TF session configuration; there is none under JAX.
        counts = collections.defaultdict(int)
        for name in self._device_names():
            match = _DEVICE_NAME.search(name)
            if match is None:
                continue
            job, task, device_type = match.group(1), int(match.group(2)), match.group(3)
            if device_type == "CPU":
                continue
            if task_type is not None and task_id is not None:
                if job != task_type or task != int(task_id):
                    continue
            counts[device_type] += 1
        return dict(counts)


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
        return _format_master_url(master, rpc_layer or self.rpc_layer)

    @property
    def environment(self):
        """The environment given to the constructor."""
        return self._environment

    def num_accelerators(self, task_type=None, task_id=None, config_proto=None):
        """The ``num_accelerators`` given to the constructor, whatever the task."""
        return dict(self._num_accelerators)


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
        return _format_master_url(spec.task_address(task_type, task_id), rpc_layer)

    def num_accelerators(self, task_type=None, task_id=None, config_proto=None):
        """Accelerators of a task, by default the ``TF_CONFIG`` task."""
        task_type = self.task_type if task_type is None else task_type
        task_id = self.task_id if task_id is None else task_id
        return super().num_accelerators(task_type, task_id, config_proto)


class UnionClusterResolver(ClusterResolver):
    """Merges the clusters of several resolvers; the first one gives this task.

    Jobs present in several resolvers are concatenated (lists) or merged
    (sparse dicts; a task index present twice raises ``KeyError``).

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
            return _format_master_url(master, rpc_layer or self.rpc_layer)
        return self._resolvers[0].master(rpc_layer=rpc_layer)

    def num_accelerators(self, task_type=None, task_id=None, config_proto=None):
        """The first resolver's ``num_accelerators``."""
        return self._resolvers[0].num_accelerators(task_type, task_id, config_proto)


def _expand_hostlist(hostlist):
    """Expands a Slurm host list: ``"node[01-03,7],other"`` → node01 node02 node03 node7 other."""
    hosts = []
    # Commas separate hosts only outside brackets.
    for item in re.findall(r"[^,\[]+(?:\[[^\]]*\][^,\[]*)*", hostlist):
        match = re.fullmatch(r"([^\[]*)\[([^\]]*)\](.*)", item)
        if match is None:
            hosts.append(item)
            continue
        prefix, ranges, suffix = match.groups()
        for part in ranges.split(","):
            start, _, end = part.partition("-")
            for number in range(int(start), int(end or start) + 1):
                hosts.extend(_expand_hostlist(f"{prefix}{number:0{len(start)}d}{suffix}"))
    return hosts


def _expand_tasks_per_node(value):
    """Expands Slurm's ``"2(x3),1"`` into ``[2, 2, 2, 1]``."""
    counts = []
    for part in value.split(","):
        match = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", part.strip())
        if match is None:
            raise ValueError(f"Cannot parse the Slurm tasks per node. Received: {value!r}")
        counts.extend([int(match.group(1))] * int(match.group(2) or 1))
    return counts


class SlurmClusterResolver(ClusterResolver):
    """Reads the cluster of a Slurm step from the ``SLURM_*`` environment variables.

    Tasks get ports ``port_base``, ``port_base + 1``, ... on each node, in
    Slurm's rank order; ``jobs`` (default ``{"worker": SLURM_NTASKS}``) splits
    the ranks into jobs in order. ``environ`` replaces ``os.environ``.

    >>> env = {"SLURM_PROCID": "2", "SLURM_NTASKS": "4",
    ...        "SLURM_JOB_NODELIST": "node[01-02]", "SLURM_TASKS_PER_NODE": "2(x2)"}
    >>> resolver = SlurmClusterResolver(environ=env)
    >>> resolver.cluster_spec().as_dict()
    {'worker': ['node01:8888', 'node01:8889', 'node02:8888', 'node02:8889']}
    >>> resolver.task_type, resolver.task_id, resolver.master()
    ('worker', 2, 'grpc://node02:8888')
    """

    def __init__(
        self,
        jobs=None,
        port_base=8888,
        gpus_per_node=None,
        gpus_per_task=None,
        tasks_per_node=None,
        auto_set_gpu=False,
        rpc_layer="grpc",
        *,
        environ=None,
    ):
        env = os.environ if environ is None else environ
        self._rank = int(env["SLURM_PROCID"])
        num_tasks = int(env.get("SLURM_STEP_NUM_TASKS") or env["SLURM_NTASKS"])
        nodes = _expand_hostlist(env.get("SLURM_STEP_NODELIST") or env["SLURM_JOB_NODELIST"])
        if tasks_per_node is None:
            per_node = env.get("SLURM_STEP_TASKS_PER_NODE") or env.get("SLURM_TASKS_PER_NODE")
            if per_node:
                counts = _expand_tasks_per_node(per_node)
            else:
                counts = [num_tasks // len(nodes)] * len(nodes)
            tasks_per_node = dict(zip(nodes, counts))
        elif isinstance(tasks_per_node, int):
            tasks_per_node = {node: tasks_per_node for node in nodes}
        self._jobs = dict(jobs) if jobs else {"worker": num_tasks}
        if sum(self._jobs.values()) > num_tasks:
            raise RuntimeError(
                "Requested more tasks than assigned tasks. "
                f"Received: jobs={self._jobs!r}, SLURM_NTASKS={num_tasks}"
            )
        self._port_base = port_base
        self._gpus_per_task = gpus_per_task
        # auto_set_gpu (TF sets CUDA_VISIBLE_DEVICES) is not done: JAX picks its local devices.
        del gpus_per_node, auto_set_gpu
        addresses = [
            f"{node}:{port_base + offset}"
            for node in nodes
            for offset in range(tasks_per_node[node])
        ]
        self._cluster = {}
        self.task_type, self.task_id = None, None
        start = 0
        for job, count in self._jobs.items():
            self._cluster[job] = addresses[start : start + count]
            if start <= self._rank < start + count:
                self.task_type, self.task_id = job, self._rank - start
            start += count
        self.rpc_layer = rpc_layer

    def cluster_spec(self):
        """All tasks of the Slurm step, split into ``jobs``."""
        return ClusterSpec(self._cluster)

    def master(self, task_type=None, task_id=None, rpc_layer=None):
        """The address of a task, by default this one, as ``rpc_layer://host:port``."""
        task_type = self.task_type if task_type is None else task_type
        task_id = self.task_id if task_id is None else task_id
        address = self.cluster_spec().task_address(task_type, task_id)
        return _format_master_url(address, rpc_layer or self.rpc_layer)

    def num_accelerators(self, task_type=None, task_id=None, config_proto=None):
        """``{"GPU": gpus_per_task}`` when given, else the counted local accelerators."""
        if self._gpus_per_task:
            return {"GPU": self._gpus_per_task}
        return super().num_accelerators(task_type, task_id, config_proto)


class _CoordinatorClusterResolver(ClusterResolver):
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
        return _format_master_url(self.coordinator_address, rpc_layer or self.rpc_layer)


class KubeflowClusterResolver(_CoordinatorClusterResolver):
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
_KERAS_VARS = (
    "KERAS_DISTRIBUTION_JOB_ADDRESSES",
    "KERAS_DISTRIBUTION_NUM_PROCESSES",
    "KERAS_DISTRIBUTION_PROCESS_ID",
)


class KerasDistributionClusterResolver(_CoordinatorClusterResolver):
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
        missing = [name for name in _KERAS_VARS if not env.get(name)]
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


def resolve_cluster(environ=None):
    """The resolver for the environment this process runs in, or ``None`` for one process.

    First match wins: ``TF_CONFIG`` with a cluster, ``KERAS_DISTRIBUTION_*``,
    Kubeflow's JAX variables, a Slurm step with more than one task.
    ``environ`` defaults to ``os.environ``.

    >>> resolve_cluster({}) is None
    True
    >>> resolve_cluster({"JAX_COORDINATOR_ADDRESS": "h:1", "JAX_NUM_PROCESSES": "2",
    ...                  "JAX_PROCESS_ID": "0"}).coordinator_address
    'h:1'
    """
    env = os.environ if environ is None else environ
    tf_config = TFConfigClusterResolver(environ=env)
    if tf_config.cluster_spec():
        return tf_config
    if all(env.get(name) for name in _KERAS_VARS):
        return KerasDistributionClusterResolver(environ=env)
    if KubeflowClusterResolver.detect(env):
        return KubeflowClusterResolver(environ=env)
    # A Slurm allocation of one task is one process; srun sets SLURM_PROCID for each task.
    num_tasks = env.get("SLURM_STEP_NUM_TASKS") or env.get("SLURM_NTASKS")
    has_nodes = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST")
    if env.get("SLURM_PROCID") and num_tasks and int(num_tasks) > 1 and has_nodes:
        return SlurmClusterResolver(environ=env)
    return None
