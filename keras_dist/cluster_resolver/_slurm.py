"""``SlurmClusterResolver``: the cluster of a Slurm step, from its ``SLURM_*`` variables.

Also holds the parsers of Slurm's compressed host lists and task counts.
"""

import os
import re

from keras_dist.cluster_resolver._base import ClusterResolver
from keras_dist.cluster_resolver._base import format_master_url
from keras_dist.cluster_resolver._cluster_spec import ClusterSpec


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


PORT_BASE_ENV = "KERAS_DIST_SLURM_PORT_BASE"
_DEFAULT_PORT_BASE = 8888  # TF's


def _port_base(env) -> int:
    """``KERAS_DIST_SLURM_PORT_BASE`` when set, else TF's 8888."""
    value = (env.get(PORT_BASE_ENV) or "").strip()
    if not value:
        return _DEFAULT_PORT_BASE
    if not value.isdigit() or not 0 < int(value) < 65536:
        raise ValueError(
            f"{PORT_BASE_ENV} must be a port number (1-65535). Received: {PORT_BASE_ENV}={value!r}"
        )
    return int(value)


class SlurmClusterResolver(ClusterResolver):
    """Reads the cluster of a Slurm step from the ``SLURM_*`` environment variables.

    Tasks get ports ``port_base``, ``port_base + 1``, ... on each node, in
    Slurm's rank order; ``port_base`` defaults to ``KERAS_DIST_SLURM_PORT_BASE``
    when set, else 8888 (TF's), so a job can choose its ports without code
    (two jobs sharing a node need different ones). ``jobs`` (default
    ``{"worker": SLURM_NTASKS}``) splits the ranks into jobs in order.
    ``environ`` replaces ``os.environ``.

    >>> env = {"SLURM_PROCID": "2", "SLURM_NTASKS": "4",
    ...        "SLURM_JOB_NODELIST": "node[01-02]", "SLURM_TASKS_PER_NODE": "2(x2)"}
    >>> resolver = SlurmClusterResolver(environ=env)
    >>> resolver.cluster_spec().as_dict()
    {'worker': ['node01:8888', 'node01:8889', 'node02:8888', 'node02:8889']}
    >>> resolver.task_type, resolver.task_id, resolver.master()
    ('worker', 2, 'grpc://node02:8888')
    >>> SlurmClusterResolver(environ={**env, "KERAS_DIST_SLURM_PORT_BASE": "20000"}).master()
    'grpc://node02:20000'
    """

    def __init__(
        self,
        jobs=None,
        port_base=None,
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
        port_base = _port_base(env) if port_base is None else int(port_base)
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
        return format_master_url(address, rpc_layer or self.rpc_layer)

    def num_accelerators(self, task_type=None, task_id=None, config_proto=None):
        """``{"GPU": gpus_per_task}`` when given, else the counted local accelerators."""
        if self._gpus_per_task:
            return {"GPU": self._gpus_per_task}
        return super().num_accelerators(task_type, task_id, config_proto)
