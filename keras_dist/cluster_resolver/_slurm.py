"""``SlurmClusterResolver``: the cluster of a Slurm step, from its ``SLURM_*`` variables.

Also holds the parsers of Slurm's compressed host lists and task counts.
"""

import os
import re
import subprocess

from keras_dist.cluster_resolver._base import ClusterResolver
from keras_dist.cluster_resolver._base import format_master_url
from keras_dist.cluster_resolver._cluster_spec import ClusterSpec


def _expand_hostlist(hostlist):
    """Expands a Slurm host list: ``"node[01-03,7],other"`` → node01 node02 node03 node7 other."""
    if hostlist.count("[") != hostlist.count("]"):
        raise ValueError(f'Invalid hostlist format "{hostlist}": unbalanced brackets')
    hosts = []
    # Commas separate hosts only outside brackets.
    for item in re.findall(r"[^,\[]+(?:\[[^\]]*\][^,\[]*)*|\[[^\]]*\][^,\[]*", hostlist):
        match = re.fullmatch(r"([^\[]*)\[([^\]]*)\](.*)", item)
        if match is None:
            hosts.append(item)
            continue
        prefix, ranges, suffix = match.groups()
        for part in ranges.split(","):
            bounds = re.fullmatch(r"(\d+)(?:-(\d+))?", part.strip())
            if bounds is None:
                raise ValueError(
                    f'Invalid hostlist format "{hostlist}": {part!r} is not a number or a '
                    "range of numbers such as 01-03"
                )
            start, end = bounds.group(1), bounds.group(2) or bounds.group(1)
            for number in range(int(start), int(end) + 1):
                hosts.extend(_expand_hostlist(f"{prefix}{number:0{len(start)}d}{suffix}"))
    return hosts


def _expand_tasks_per_node(value):
    """Expands Slurm's ``"2(x3),1"`` into ``[2, 2, 2, 1]``."""
    counts = []
    for part in value.split(","):
        match = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", part.strip())
        if match is None:
            raise ValueError(f'Invalid tasks-per-node list format "{value}"')
        counts.extend([int(match.group(1))] * int(match.group(2) or 1))
    return counts


def _step_variable(env, name):
    """``SLURM_<name>`` of the step this process runs in (TF's error where there is none)."""
    value = env.get(f"SLURM_{name}")
    if not value:
        raise RuntimeError(
            f"SLURM_{name} not found in environment. Not running inside a SLURM step? "
            "A batch script's own commands run outside any step: start the tasks with "
            "`srun`, which sets SLURM_STEP_* for each of them."
        )
    return value


def _count_gpus(env) -> int:
    """The GPUs this node shows: ``CUDA_VISIBLE_DEVICES``, else ``nvidia-smi``, else none."""
    visible = env.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        return len([d for d in visible.split(",") if d.strip()])
    try:
        listed = subprocess.run(
            ["nvidia-smi", "--list-gpus"], capture_output=True, text=True, timeout=30
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return 0  # no NVIDIA driver here: a CPU node
    return sum(line.startswith("GPU ") for line in listed.splitlines())


PORT_BASE_ENV = "KERAS_DIST_SLURM_PORT_BASE"
LOCAL_DEVICES_ENV = "JAX_LOCAL_DEVICE_IDS"
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

    TF's rules: the step's nodes (``SLURM_STEP_NODELIST``, in sorted order) each
    hold ``SLURM_STEP_TASKS_PER_NODE`` tasks at ports ``port_base``,
    ``port_base + 1``, ...; ``jobs`` (default ``{"worker": SLURM_STEP_NUM_TASKS}``)
    takes those tasks in the sorted order of the job names, and this process is
    the task at its rank (``SLURM_PROCID``). ``port_base`` defaults to
    ``KERAS_DIST_SLURM_PORT_BASE`` when set, else 8888 (TF's), so a job can choose
    its ports without code (two jobs sharing a node need different ones).

    GPUs: each task gets ``gpus_per_task`` of its node's ``gpus_per_node``
    (defaults: the GPUs ``CUDA_VISIBLE_DEVICES`` or ``nvidia-smi`` shows, split
    evenly between the node's tasks). With ``auto_set_gpu`` (TF's default),
    ``cluster_spec()`` sets ``JAX_LOCAL_DEVICE_IDS`` to this task's GPUs where
    the user has not: JAX's counterpart of TF setting ``CUDA_VISIBLE_DEVICES``.
    ``environ`` replaces ``os.environ``.

    >>> env = {"SLURM_PROCID": "2", "SLURM_STEP_NUM_TASKS": "4",
    ...        "SLURM_STEP_NODELIST": "node[01-02]", "SLURM_STEP_TASKS_PER_NODE": "2(x2)"}
    >>> resolver = SlurmClusterResolver(environ=env)
    >>> resolver.cluster_spec().as_dict()
    {'worker': ['node01:8888', 'node01:8889', 'node02:8888', 'node02:8889']}
    >>> resolver.get_task_info(), resolver.master()
    (('worker', 2), 'grpc://node02:8888')
    >>> SlurmClusterResolver(jobs={"worker": 2, "ps": 1, "chief": 1}, environ=env).get_task_info()
    ('worker', 0)
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
        auto_set_gpu=True,
        rpc_layer="grpc",
        *,
        environ=None,
    ):
        env = os.environ if environ is None else environ
        self._environ = env
        self._rank = int(_step_variable(env, "PROCID"))
        if isinstance(tasks_per_node, dict):
            configuration = {str(node): int(count) for node, count in tasks_per_node.items()}
        else:
            nodes = _expand_hostlist(_step_variable(env, "STEP_NODELIST"))
            if tasks_per_node is None:
                counts = _expand_tasks_per_node(_step_variable(env, "STEP_TASKS_PER_NODE"))
            else:
                counts = [int(tasks_per_node)] * len(nodes)
            configuration = dict(zip(nodes, counts))
        self._configuration = dict(sorted(configuration.items()))  # TF's node order
        num_tasks = sum(self._configuration.values())
        if jobs is None:
            jobs = {"worker": int(_step_variable(env, "STEP_NUM_TASKS"))}
        self._jobs = dict(sorted(dict(jobs).items()))  # TF's order of jobs
        if sum(self._jobs.values()) != num_tasks:
            raise RuntimeError(
                f"Requested {sum(self._jobs.values())} tasks but only {num_tasks} were "
                f"assigned. Received: jobs={dict(jobs)!r}, tasks per node="
                f"{self._configuration!r}"
            )
        if not 0 <= self._rank < num_tasks:
            raise ValueError(
                f"SLURM_PROCID is not a task of this step of {num_tasks} tasks. Received: "
                f"SLURM_PROCID={self._rank}"
            )
        self._port_base = _port_base(env) if port_base is None else int(port_base)
        most = max(self._configuration.values(), default=1)
        if not 0 < self._port_base or self._port_base + most - 1 > 65535:
            raise ValueError(
                f"The ports of a node's {most} tasks from port_base must be 1-65535. "
                f"Received: port_base={self._port_base}"
            )
        self._gpus_per_node = _count_gpus(env) if gpus_per_node is None else int(gpus_per_node)
        if gpus_per_task is None:
            gpus_per_task = self._gpus_per_node // most
        self._gpus_per_task = int(gpus_per_task)
        if most * self._gpus_per_task > self._gpus_per_node:
            raise RuntimeError(
                "Requested more GPUs per node than available. Received: "
                f"gpus_per_task={self._gpus_per_task} for {most} tasks a node, "
                f"gpus_per_node={self._gpus_per_node}"
            )
        self._auto_set_gpu = auto_set_gpu
        self._cluster, self._addresses, start = {}, [], 0
        for node, count in self._configuration.items():
            self._addresses += [(node, offset) for offset in range(count)]
        self.task_type, self.task_id = None, None
        for job, count in self._jobs.items():
            self._cluster[job] = [
                f"{node}:{self._port_base + offset}"
                for node, offset in self._addresses[start : start + count]
            ]
            if start <= self._rank < start + count:
                self.task_type, self.task_id = job, self._rank - start
            start += count
        self.rpc_layer = rpc_layer

    def get_task_info(self):
        """``(task_type, task_id)`` of this process (TF's method)."""
        return self.task_type, self.task_id

    def local_gpu_ids(self) -> list:
        """This task's GPUs on its node: a share of ``gpus_per_node`` by its place there.

        Where Slurm bound GPUs to each task (``CUDA_VISIBLE_DEVICES`` shows fewer than
        one a task), the task uses all it sees.
        """
        visible = self._environ.get("CUDA_VISIBLE_DEVICES")
        if not self._gpus_per_task and visible:
            return list(range(_count_gpus({"CUDA_VISIBLE_DEVICES": visible})))
        _, offset = self._addresses[self._rank]
        first = offset * self._gpus_per_task
        return list(range(first, first + self._gpus_per_task))

    def cluster_spec(self):
        """All tasks of the Slurm step, split into ``jobs`` (and this task's GPUs chosen)."""
        gpus = self.local_gpu_ids()
        if self._auto_set_gpu and gpus and not self._environ.get(LOCAL_DEVICES_ENV):
            # JAX reads it when the cluster starts; Slurm's own per-task default
            # (one GPU each, by SLURM_LOCALID) would ignore gpus_per_task.
            self._environ[LOCAL_DEVICES_ENV] = ",".join(map(str, gpus))
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
