"""Parameter-server clusters for tests (TF's ``multi_worker_test_base``).

``create_in_process_cluster`` starts every ps and worker server in this
process, as TF's does: the servers live as long as the process.
``create_multi_process_cluster`` starts one process per task, so tests can
kill and restart tasks.
"""

import os
import time

from keras_dist import errors
from keras_dist._launch import MultiProcessRunner
from keras_dist._launch import create_cluster_spec
from keras_dist._launch import pick_unused_port
from keras_dist.cluster_resolver import SimpleClusterResolver
from keras_dist.cluster_resolver import TFConfigClusterResolver
from keras_dist.parameter_server.rpc import _protocol as protocol
from keras_dist.parameter_server.rpc._auth import TOKEN_ENV
from keras_dist.parameter_server.rpc._auth import new_token
from keras_dist.parameter_server.rpc._transport import RpcClient
from keras_dist.parameter_server.tasks._server import Server

# In-process servers live as long as the process (TF's cannot be stopped either).
_SERVERS: list = []


def create_in_process_cluster(
    num_workers, num_ps, has_chief=False, has_eval=False, rpc_layer="grpc"
):
    """Starts ``num_workers`` worker and ``num_ps`` ps servers here; returns a resolver.

    The resolver has no task type: the process using it is the coordinator.

    >>> import keras_dist as kd
    >>> resolver = kd.testing.create_in_process_cluster(num_workers=2, num_ps=1)
    >>> sorted(resolver.cluster_spec().jobs)
    ['ps', 'worker']
    """
    cluster = {
        "worker": [f"127.0.0.1:{pick_unused_port()}" for _ in range(num_workers)],
        "ps": [f"127.0.0.1:{pick_unused_port()}" for _ in range(num_ps)],
    }
    if has_chief:
        cluster["chief"] = [f"127.0.0.1:{pick_unused_port()}"]
    if has_eval:
        cluster["evaluator"] = [f"127.0.0.1:{pick_unused_port()}"]
    for job in ("worker", "ps"):
        for index in range(len(cluster[job])):
            _SERVERS.append(Server(cluster, job_name=job, task_index=index))
    return SimpleClusterResolver(cluster, rpc_layer=rpc_layer)


def in_process_servers() -> list:
    """The servers ``create_in_process_cluster`` started (tests stop one to lose a task)."""
    return list(_SERVERS)


def _serve_from_tf_config():
    """A task of a multi-process cluster: its server, from TF_CONFIG, until killed."""
    server = Server(TFConfigClusterResolver())
    server.join()


class MultiProcessCluster:
    """ps and worker servers, one process each, for fault-tolerance tests (TF's).

    ``kill_task(type, i)`` kills a task at once (SIGKILL, as a crash);
    ``start_task(type, i)`` starts it again at the same address. The process
    that made the cluster is the coordinator: ``cluster_resolver`` is its
    resolver (the chief's when ``has_chief``).

    A sketch (it starts processes, so it is not run here)::

        cluster = kd.testing.create_multi_process_cluster(num_workers=2, num_ps=1)
        strategy = kd.ParameterServerStrategy(cluster.cluster_resolver)
        cluster.kill_task("worker", 1)   # its closures move to worker 0
        cluster.start_task("worker", 1)  # it rejoins at the same address
    """

    def __init__(
        self,
        num_workers,
        num_ps,
        has_chief=False,
        rpc_layer="grpc",
        timeout=60.0,
        devices_per_worker=None,
    ):
        cluster = create_cluster_spec(has_chief=has_chief, num_workers=num_workers, num_ps=num_ps)
        self._cluster = cluster
        # Every task and this process share one token; tasks refuse anyone else.
        os.environ.setdefault(TOKEN_ENV, new_token())
        served = {job: tasks for job, tasks in cluster.items() if job in ("worker", "ps")}
        self._runner = MultiProcessRunner(
            _serve_from_tf_config,
            served,
            env={TOKEN_ENV: os.environ[TOKEN_ENV]},
            stream_output=False,
            dependence_on_chief=False,
            # The coordinator gives a lost worker's work to the others (TF's fault tolerance).
            survivable=("worker",),
            terminate_grace=5.0,
            devices_per_worker=devices_per_worker,
        )
        task_type, task_id = ("chief", 0) if has_chief else (None, None)
        self.cluster_resolver = SimpleClusterResolver(
            cluster, task_type=task_type, task_id=task_id, rpc_layer=rpc_layer
        )
        self._timeout = timeout
        self._runner.start()
        for job in ("ps", "worker"):
            for index in range(len(served[job])):
                self.wait_for_task(job, index)

    def wait_for_task(self, task_type: str, task_id: int) -> dict:
        """The task's answer to a ping once it serves; raises with its log after ``timeout``."""
        address = self._cluster[task_type][task_id]
        client = RpcClient(address, name=f"/job:{task_type}/replica:0/task:{task_id}")
        deadline = time.monotonic() + self._timeout
        try:
            while True:
                try:
                    reply, _, _ = client.call(protocol.request(protocol.PING), timeout=2.0)
                    return reply
                except errors.OpError:
                    if time.monotonic() > deadline:
                        raise RuntimeError(
                            f"Task {task_type}:{task_id} did not start serving within "
                            f"{self._timeout} s. Its log:\n{self.logs(task_type, task_id)}"
                        ) from None
                    time.sleep(0.2)
        finally:
            client.close()

    def worker_devices(self, task_id: int) -> int:
        """How many devices worker ``task_id`` runs each step on (it splits the batch)."""
        return self.wait_for_task("worker", task_id)["devices"]

    def kill_task(self, task_type: str, task_id: int) -> None:
        """Kills a task's process now (SIGKILL)."""
        self._runner.kill(task_type, task_id)

    def start_task(self, task_type: str, task_id: int) -> None:
        """Starts a killed task again, at the same address, and waits until it serves."""
        self._runner.start_single_process(task_type, task_id)
        self.wait_for_task(task_type, task_id)

    def logs(self, task_type: str, task_id: int) -> str:
        return self._runner.logs(task_type, task_id)

    def pid(self, task_type: str, task_id: int) -> int:
        """The process id of the task's current process (to measure or signal it)."""
        return self._runner.process_status()[(task_type, task_id)].pid

    def all_logs(self) -> str:
        """Every task's log, for a failing test to print."""
        return "\n".join(
            f"--- {job} {i} ---\n{self.logs(job, i)}"
            for job in ("ps", "worker")
            for i in range(len(self._cluster[job]))
        )

    def stop(self) -> None:
        """Stops every task."""
        self._runner.close()


def create_multi_process_cluster(
    num_workers, num_ps, has_chief=False, rpc_layer="grpc", devices_per_worker=None
):
    """Starts one process per ps and worker task; returns a ``MultiProcessCluster``.

    ``devices_per_worker`` gives each task that many simulated CPU devices (one
    count, or one per task: the workers', then the ps tasks'); a worker runs
    every step on all of its devices.

    >>> import keras_dist as kd
    >>> cluster = kd.testing.create_multi_process_cluster(num_workers=1, num_ps=1)
    >>> sorted(cluster.cluster_resolver.cluster_spec().jobs)
    ['ps', 'worker']
    >>> cluster.stop()
    """
    return MultiProcessCluster(
        num_workers,
        num_ps,
        has_chief=has_chief,
        rpc_layer=rpc_layer,
        devices_per_worker=devices_per_worker,
    )
