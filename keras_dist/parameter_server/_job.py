"""Jobs with parameter servers: when the job ends, and the token its tasks share.

A parameter-server job ends when its chief does (coordinator mode), or when
every worker does (between-graph mode): the ps tasks, and in coordinator mode
the workers' servers, serve until then and are stopped, as TF's launchers do.
Every task gets the same ``KERAS_DIST_CLUSTER_TOKEN`` (made here when unset):
the servers refuse requests without it.
"""

import os
import time

from keras_dist.parameter_server.rpc._auth import TOKEN_ENV
from keras_dist.parameter_server.rpc._auth import new_token

_POLL_INTERVAL = 0.2


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
