"""Jobs with parameter servers: when the job ends, and the token its tasks share.

A parameter-server job ends when its chief does (coordinator mode), or when
every worker does (between-graph mode): the ps tasks, and in coordinator mode
the workers' servers, serve until then and are stopped, as TF's launchers do.
A chief task also stops them itself when its program ends (``stop_servers_at_exit``),
so that a job started by a launcher that knows nothing of the job's roles (``srun``,
by hand) ends with the chief too.
Every task gets the same ``KERAS_DIST_CLUSTER_TOKEN`` (made here when unset):
the servers refuse requests without it.
"""

import atexit
import logging
import os
import threading
import time

from keras_dist.parameter_server.rpc._auth import TOKEN_ENV
from keras_dist.parameter_server.rpc._auth import new_token

logger = logging.getLogger("keras_dist.ps")

_POLL_INTERVAL = 0.2
_STOP_TIMEOUT = 5.0  # seconds for all the servers to answer `stop` (a gone one never does)
# The clusters (their ps and worker addresses) this chief stops at exit, each once.
_clusters_to_stop: set = set()
_clusters_lock = threading.Lock()


def ps_environment(env: "dict | None") -> dict:
    """``env`` with the cluster token every task of a parameter-server job shares."""
    env = dict(env or {})
    env.setdefault(TOKEN_ENV, os.environ.get(TOKEN_ENV) or new_token())
    return env


def join_job(runner, cluster: dict, timeout: "float | None") -> list:
    """Waits for the job's main tasks, stops its servers, returns the main tasks' results.

    The main tasks are the chief when there is one, else the workers; results
    come chief first, then the workers (a server's result is ``None``).
    """
    main = [("chief", 0)] if "chief" in cluster else []
    main = main or [("worker", i) for i in range(len(cluster["worker"]))]
    deadline = None if timeout is None else time.monotonic() + timeout
    while deadline is None or time.monotonic() < deadline:
        status = runner.process_status()
        if any(status[key].state == "failed" for key in status):
            break  # the runner stops the rest after its grace and join reports it
        if all(status[key].state != "running" for key in main):
            for key, task in status.items():
                if key not in main and task.state == "running":
                    runner.terminate(*key, grace=5.0)
            break
        time.sleep(_POLL_INTERVAL)
    remaining = None if deadline is None else max(deadline - time.monotonic(), 0.0)
    results = runner.join(timeout=remaining)
    keys = list(runner.process_status())
    return [value for key, value in zip(keys, results) if key[0] in ("chief", "worker")]


def _servers(cluster_spec) -> tuple:
    """``((task name, address), ...)`` of the cluster's ps and worker tasks."""
    return tuple(
        (f"/job:{job}/replica:0/task:{index}", cluster_spec.task_address(job, index))
        for job in ("ps", "worker")
        if job in cluster_spec.jobs
        for index in cluster_spec.task_indices(job)
    )


def stop_servers_at_exit(cluster_spec) -> None:
    """When this (chief) process exits, tells the cluster's ps and worker servers to stop.

    Their ``Server.join()`` returns and a ps task's ``ParameterServerStrategy()``
    ends its process (status 0): the job ends with the chief, whatever started
    the tasks. Runs at exit however the chief's program ends, returned or raised.
    """
    servers = _servers(cluster_spec)
    with _clusters_lock:
        first = not _clusters_to_stop
        _clusters_to_stop.add(servers)
    if first:
        atexit.register(_stop_registered_servers)


def _stop_registered_servers() -> None:
    with _clusters_lock:
        servers = sorted({server for cluster in _clusters_to_stop for server in cluster})
        _clusters_to_stop.clear()
    stop_servers(servers)


def stop_servers(servers, timeout: float = _STOP_TIMEOUT) -> None:
    """Sends ``stop`` to every ``(task name, address)`` at once; waits ``timeout`` at most.

    A server that is already gone, or refuses, is logged and skipped: the job is over.
    """
    # Imported here: the launcher imports this module and needs no gRPC.
    from keras_dist.parameter_server.rpc import _protocol as protocol
    from keras_dist.parameter_server.rpc._transport import RpcClient

    def stop(name, address):
        client = RpcClient(address, name=name)
        try:
            client.call(protocol.request(protocol.STOP), timeout=timeout)
        except Exception as error:  # noqa: BLE001 - at exit: report, never raise
            logger.info("Could not stop %s at %s: %s", name, address, error)
        finally:
            client.close()

    threads = [
        threading.Thread(target=stop, args=server, name="kd-stop-server", daemon=True)
        for server in servers
    ]
    for thread in threads:
        thread.start()
    deadline = time.monotonic() + timeout
    for thread in threads:
        thread.join(max(deadline - time.monotonic(), 0.0))
