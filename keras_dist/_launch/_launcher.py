"""``launch``: run a function on a local cluster of processes, restarting the whole cluster.

Restarts follow torchrun's elastic agent rather than TF's ``auto_restart``: when a task fails,
every task is stopped and the whole cluster starts again on fresh ports, so a job that saves
with ``BackupAndRestore`` resumes from its last backup.

Elastic jobs (``min_workers`` below ``num_workers``) also shrink: each worker stands for
a machine, and the worker an attempt's failure is blamed on (the first to fail, not the
peers that failed because of it: see ``_blame``) counts as gone for good when a signal
killed it (a lost machine's process dies that way: SIGKILL, or an out-of-memory kill) or
when it fails in two attempts in a row. The next attempt already runs without it, on
fewer workers (never fewer than ``min_workers``): a restart on the same machines would be
spent only to see it fail again. The workers are numbered again from 0, and ``fit``'s
global batch stays what the script says, so each replica's share grows.
"""

import sys
import time

from keras_dist._launch._cluster import create_cluster_spec
from keras_dist._launch._errors import UnexpectedSubprocessExitError
from keras_dist._launch._errors import WorkerError
from keras_dist._launch._hosts import check_hosts
from keras_dist._launch._hosts import host_of
from keras_dist._launch._hosts import unreachable_hosts
from keras_dist._launch._runner import MultiProcessRunner
from keras_dist.parameter_server._job import join_job
from keras_dist.parameter_server._job import ps_environment


def launch(
    fn,
    num_workers: int = 2,
    *,
    has_chief: bool = False,
    num_ps: int = 0,
    args=(),
    kwargs: dict | None = None,
    devices_per_worker: "int | list[int] | None" = None,
    env: dict[str, str] | None = None,
    timeout: float | None = None,
    max_restarts: int = 0,
    min_workers: int | None = None,
    stream_output: bool = True,
    failure_grace: float = 30.0,
    hosts: "list[str] | None" = None,
    host_command: str | None = None,
) -> list:
    """Runs ``fn(*args, **kwargs)`` in ``num_workers`` local processes; returns their results.

    Every process is one task of a cluster on 127.0.0.1 (free ports), with ``TF_CONFIG`` set,
    so ``MultiWorkerMirroredStrategy()`` inside ``fn`` joins the others. Works from a script
    and from a notebook (``fn`` may be defined in a cell).

    Args:
        fn: The function every task calls; its return value must be picklable.
        num_workers: The number of ``"worker"`` tasks.
        has_chief: Whether to add a ``"chief"`` task (it comes first in the results).
        num_ps: ``"ps"`` tasks (``ParameterServerStrategy``). The job then ends
            when the chief ends (or, without a chief, every worker); the other
            tasks, which serve, are stopped, and their results are left out.
        args: Positional arguments of ``fn``.
        kwargs: Keyword arguments of ``fn``.
        devices_per_worker: Simulated CPU devices per task, or a list with one count per
            task (chief, workers, then ps) for tasks with different device counts; by
            default one device each.
        env: Environment variables for every task.
        timeout: Seconds for the whole call, restarts included; then every task is stopped
            and ``SubprocessTimeoutError`` is raised. ``None`` for no limit.
        max_restarts: How many times the whole cluster may start again, on new ports, after
            a task failed.
        min_workers: Makes the job elastic: a worker killed by a signal, or that fails in
            two attempts in a row, is left out of the next ones, down to ``min_workers``
            workers (each restart counts against ``max_restarts``). By default
            ``num_workers``: never shrink.
        stream_output: Print every task's output as it comes, prefixed ``[worker 1] ``.
        failure_grace: Seconds the other tasks get after a task failed (to finish, or to
            report their own error) before they are stopped.
        hosts: One host address per task (chief, workers, then ps) to run it on, instead
            of 127.0.0.1; each worker's host stands for its machine in an elastic job.
        host_command: How a task reaches its host: a command line whose ``{host}`` is the
            address (``"ssh {host}"``). The hosts share this machine's file system.

    Returns:
        The return value of every task: chief first, then the workers by index.

    Raises:
        WorkerError: a task's function raised (also an instance of its exception's type).
        UnexpectedSubprocessExitError: a task exited non-zero or was killed.
        SubprocessTimeoutError: ``timeout`` passed.

    >>> def square(x):
    ...     import json, os
    ...     return json.loads(os.environ["TF_CONFIG"])["task"]["index"] ** x
    >>> launch(square, num_workers=3, args=(2,), stream_output=False, timeout=60)
    [0, 1, 4]
    """

    if num_ps:
        env = ps_environment(env)

    def runner(cluster, kept_workers):
        return MultiProcessRunner(
            fn,
            cluster,
            args=args,
            kwargs=kwargs,
            env=env,
            devices_per_worker=kept_per_task(
                devices_per_worker, has_chief, num_workers, kept_workers
            ),
            stream_output=stream_output,
            # A parameter-server job goes on without a failed worker, as TF's does.
            survivable=("worker",) if num_ps else (),
            failure_grace=failure_grace,
            host_command=host_command,
        )

    return run_elastic(
        runner,
        num_workers=num_workers,
        has_chief=has_chief,
        max_restarts=max_restarts,
        timeout=timeout,
        verbose=stream_output,
        num_ps=num_ps,
        min_workers=min_workers,
        hosts=check_hosts(hosts, host_command, int(has_chief) + num_workers + num_ps),
        host_command=host_command,
    )


def kept_per_task(per_task, has_chief, num_workers, kept_workers):
    """The entries (device counts, hosts) of the tasks an elastic job still has.

    One value for every task (not a list) stays as it is.

    >>> kept_per_task([1, 2, 4, 8, 1], True, 3, [0, 2])  # chief, workers 0 and 2, ps
    [1, 2, 8, 1]
    """
    if not isinstance(per_task, (list, tuple)):
        return per_task
    lead = 1 if has_chief else 0
    counts = list(per_task)
    workers = counts[lead : lead + num_workers]
    if len(workers) != num_workers:
        return counts  # the runner reports the mismatch
    return counts[:lead] + [workers[i] for i in kept_workers] + counts[lead + num_workers :]


def run_elastic(
    make_runner,
    *,
    num_workers,
    has_chief,
    max_restarts,
    timeout,
    verbose=True,
    num_ps=0,
    min_workers=None,
    hosts=None,
    host_command=None,
) -> list:
    """Runs ``make_runner(cluster_spec, kept_workers)`` until it succeeds.

    At most ``max_restarts + 1`` attempts, each on a new cluster with fresh ports;
    a timeout is not retried. ``kept_workers`` are the indices, among the first
    attempt's ``num_workers``, of the workers this attempt has: with
    ``min_workers`` below ``num_workers``, the failed worker is left out once it is
    known to be gone: killed by a signal, or failed in the last two attempts (see the
    module's docstring). ``verbose`` prints a line before each restart. ``hosts``: each
    task's host (``check_hosts``), or ``None`` for 127.0.0.1; then a worker whose host the
    other hosts cannot reach (``host_command`` runs their probes) is gone for good, whatever
    the failure's blame says.
    """
    if not isinstance(max_restarts, int) or max_restarts < 0:
        raise ValueError(
            "`max_restarts` must be a non-negative integer. "
            f"Received: max_restarts={max_restarts!r}"
        )
    if timeout is not None and (isinstance(timeout, bool) or timeout <= 0):
        raise ValueError(
            f"`timeout` must be None or positive seconds. Received: timeout={timeout!r}"
        )
    min_workers = num_workers if min_workers is None else min_workers
    if not isinstance(min_workers, int) or not 1 <= min_workers <= num_workers:
        raise ValueError(
            "`min_workers` must be an integer from 1 to the number of workers "
            f"({num_workers}). Received: min_workers={min_workers!r}"
        )
    deadline = None if timeout is None else time.monotonic() + timeout
    kept = list(range(num_workers))  # each worker stands for a machine
    last_failed = None
    attempt = 0
    while True:
        cluster = create_cluster_spec(
            has_chief=has_chief,
            num_workers=len(kept),
            num_ps=num_ps,
            hosts=kept_per_task(hosts, has_chief, num_workers, kept),
        )
        with make_runner(cluster, list(kept)) as runner:
            runner.start()
            remaining = None if deadline is None else max(deadline - time.monotonic(), 0.0)
            try:
                if num_ps:
                    return join_job(runner, cluster, remaining)
                return runner.join(timeout=remaining)
            except (WorkerError, UnexpectedSubprocessExitError) as error:
                if attempt == max_restarts:
                    raise
                attempt += 1
                failed = kept[error.task_id] if error.task_type == "worker" else None
                summary = str(error).splitlines()[0].rstrip(".")
                gone = _why_gone(error, failed, last_failed)
                dropped = [failed] if gone is not None else []
                if host_command is not None and len(kept) > min_workers:
                    # Hosts of their own: the hosts' own view of the network decides.
                    lost = _unreachable_workers(cluster, host_command, kept)
                    if lost:
                        dropped, gone = lost, _unreachable_clause(cluster, kept, lost)
                dropped = dropped[: len(kept) - min_workers]
                if dropped:
                    kept = [machine for machine in kept if machine not in dropped]
                    last_failed = None
                    message = (
                        f"{summary}{gone}: continuing without "
                        f"{'that machine' if len(dropped) == 1 else 'those machines'}, on "
                        f"{len(kept)} workers (min {min_workers}; restart {attempt} of "
                        f"{max_restarts})."
                    )
                else:
                    last_failed = failed
                    message = (
                        f"{summary}; restarting every task on new ports "
                        f"(restart {attempt} of {max_restarts})."
                    )
                if verbose:
                    _announce(message)


def _unreachable_workers(cluster, host_command, kept) -> list:
    """The machines (indices of the first attempt's workers) whose host the others lost."""
    return [kept[i] for i in sorted(unreachable_hosts(host_command, cluster["worker"]))]


def _unreachable_clause(cluster, kept, lost) -> str:
    hosts = ", ".join(host_of(cluster["worker"][kept.index(m)]) for m in lost)
    return f"; the other hosts cannot reach {hosts}"


def _why_gone(error, failed, last_failed) -> str | None:
    """Why the failed worker's machine counts as gone (a clause), or ``None`` if it may not be.

    Killed by a signal: the process did not fail, it died (its machine lost, the kernel's
    out-of-memory kill); restarting it on the same machines would only fail again.
    """
    if failed is None:
        return None
    code = error.exit_codes.get((error.task_type, error.task_id))
    if code is not None and code < 0:
        return ""  # the summary says "killed by SIGKILL"
    return ", in two attempts in a row" if failed == last_failed else None


def _announce(message: str) -> None:
    # Through sys.stdout like the tasks' lines, so it shows in order (and in notebooks).
    if sys.stdout is not None:
        sys.stdout.write(f"[keras-dist] {message}\n")
        sys.stdout.flush()
