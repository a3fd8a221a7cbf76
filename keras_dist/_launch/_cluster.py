"""Local clusters: free ports, cluster specs, and the order of their tasks.

Follows TF's ``multi_worker_test_base``: every task of a local cluster is
``127.0.0.1:<free port>``, and a task learns its place from ``TF_CONFIG``.
"""

import json
import socket
import threading

from keras_dist.cluster_resolver import ClusterSpec

_LOCALHOST = "127.0.0.1"
# Jobs whose tasks come first, in this order; other jobs follow in the spec's order.
_LEADING_JOBS = ("chief", "worker")

_picked_ports: set[int] = set()
_picked_ports_lock = threading.Lock()


def pick_unused_port() -> int:
    """A TCP port that is free on 127.0.0.1 and that this process has not returned before.

    The operating system picks a free port; remembering the ports already handed out keeps two
    tasks of one cluster from getting the same port when the system hands it out twice.

    >>> port = pick_unused_port()
    >>> 0 < port < 65536 and port != pick_unused_port()
    True
    """
    for _ in range(1000):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.bind((_LOCALHOST, 0))
            port = sock.getsockname()[1]
        with _picked_ports_lock:
            if port not in _picked_ports:
                _picked_ports.add(port)
                return port
    raise RuntimeError("No unused port found on 127.0.0.1 after 1000 tries.")


def create_cluster_spec(
    has_chief: bool = False,
    num_workers: int = 1,
    num_ps: int = 0,
    has_eval: bool = False,
    hosts: "list[str] | None" = None,
) -> dict[str, list[str]]:
    """A cluster of tasks on 127.0.0.1 with free ports, as a ``TF_CONFIG`` cluster dict.

    Args:
        has_chief: Whether the cluster has a ``"chief"`` task.
        num_workers: The number of ``"worker"`` tasks.
        num_ps: The number of ``"ps"`` (parameter server) tasks.
        has_eval: Whether the cluster has an ``"evaluator"`` task.
        hosts: Each task's host address instead of 127.0.0.1, in task order (chief,
            workers, ps, evaluator); the ports are ones free here.

    >>> spec = create_cluster_spec(has_chief=True, num_workers=2)
    >>> list(spec), len(spec["worker"])
    (['chief', 'worker'], 2)
    >>> spec["chief"][0].startswith("127.0.0.1:")
    True
    """
    for name, count in (("num_workers", num_workers), ("num_ps", num_ps)):
        if not isinstance(count, int) or count < 0:
            raise ValueError(f"`{name}` must be a non-negative integer. Received: {name}={count!r}")
    counts = {"chief": int(has_chief), "worker": num_workers, "ps": num_ps}
    counts["evaluator"] = int(has_eval)
    if hosts is not None and len(hosts) != sum(counts.values()):
        raise ValueError(
            f"`hosts` must give one address per task ({sum(counts.values())}). "
            f"Received: hosts={hosts!r}"
        )
    places = iter(hosts or [_LOCALHOST] * sum(counts.values()))
    spec = {
        job: [f"{next(places)}:{pick_unused_port()}" for _ in range(count)]
        for job, count in counts.items()
        if count
    }
    if not spec:
        raise ValueError(
            "The cluster has no task. Received: has_chief=False, num_workers=0, num_ps=0, "
            "has_eval=False."
        )
    return spec


def task_keys(cluster_spec) -> list[tuple[str, int]]:
    """The ``(task_type, task_id)`` of every task: chief, workers, then the other jobs.

    >>> task_keys({"worker": ["a:1", "b:1"], "chief": ["c:1"]})
    [('chief', 0), ('worker', 0), ('worker', 1)]
    """
    spec = ClusterSpec(cluster_spec)
    jobs = [job for job in _LEADING_JOBS if job in spec.jobs]
    jobs += [job for job in spec.jobs if job not in _LEADING_JOBS]
    keys = [(job, index) for job in jobs for index in spec.task_indices(job)]
    if not keys:
        raise ValueError(f"The cluster spec has no task. Received: cluster_spec={cluster_spec!r}")
    return keys


def tf_config(cluster_spec, task_type: str, task_id: int) -> str:
    """The ``TF_CONFIG`` value (JSON) of one task of the cluster.

    >>> tf_config({"worker": ["127.0.0.1:5000"]}, "worker", 0)
    '{"cluster": {"worker": ["127.0.0.1:5000"]}, "task": {"type": "worker", "index": 0}}'
    """
    cluster = ClusterSpec(cluster_spec).as_dict()
    return json.dumps({"cluster": cluster, "task": {"type": task_type, "index": task_id}})
