"""One task of a larger MultiWorkerMirroredStrategy job killed mid-fit: every survivor names it.

Four and five processes, the task killed (SIGKILL, at a moment inside a step; or frozen by
SIGSTOP, where survivors raise TF's error for a stuck peer) being the
first, a middle or the last one, and the coordinator's host (process 0: the chief, else
worker 0, which hosts JAX's coordination service). Each survivor must raise
``UnavailableError`` naming the lost task and only it, and exit with status 1: no
survivor aborts (gloo, JAX's "the JAX distributed service detected fatal errors") and
none is blamed.
"""

import pytest

import keras_dist as kd
from keras_dist import testing

pytestmark = pytest.mark.multiprocess

TIMEOUT = 240  # seconds per cluster; a hang fails the test with every task's log
COLLECTIVE_TIMEOUT = 30


def _fit_until_one_is_killed(victim: str, signum=None, timeout_seconds=COLLECTIVE_TIMEOUT):
    import os
    import signal
    import threading
    import time

    import keras
    import numpy as np

    strategy = kd.MultiWorkerMirroredStrategy(
        communication_options=kd.experimental.CommunicationOptions(timeout_seconds=timeout_seconds)
    )
    resolver = strategy.cluster_resolver
    me = f"{resolver.task_type} {resolver.task_id}"

    class KillVictim(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            if me == victim and batch == 20:
                # Killed a moment later, while the next steps run (inside a collective).
                how = signal.SIGKILL if signum is None else signum
                threading.Timer(0.05, os.kill, (os.getpid(), how)).start()

    with strategy.scope():
        model = keras.Sequential(
            [keras.Input((20,)), keras.layers.Dense(21), keras.layers.Dense(1)]
        )
        model.compile(optimizer="sgd", loss="mse")
    x, y = np.ones((6400, 20), "float32"), np.ones((6400, 1), "float32")
    start = time.monotonic()
    try:
        model.fit(x, y, batch_size=64, epochs=50, verbose=0, callbacks=[KillVictim()])
    except kd.errors.OpError as error:
        seconds = time.monotonic() - start
        print(f"SURVIVOR {me} {type(error).__name__} after {seconds:.1f} s: {error}", flush=True)
        raise
    return "finished"


def _task_names(cluster):
    return [f"{job} {i}" for job in ("chief", "worker") for i in range(len(cluster.get(job, [])))]


def _lose_one(has_chief, num_workers, victim, signum=None, timeout_seconds=COLLECTIVE_TIMEOUT):
    """Runs the cluster until it fails; each task's (log, exit code), and all logs as text."""
    cluster = testing.create_cluster_spec(has_chief=has_chief, num_workers=num_workers)
    with testing.MultiProcessRunner(
        _fit_until_one_is_killed,
        cluster,
        args=(victim, signum, timeout_seconds),
        devices_per_worker=1,
        stream_output=False,
        dependence_on_chief=False,
        failure_grace=timeout_seconds + 40,
        terminate_grace=2,
    ) as runner:
        runner.start()
        with pytest.raises((testing.UnexpectedSubprocessExitError, testing.WorkerError)):
            runner.join(timeout=TIMEOUT)
        logs = {}
        for name in _task_names(cluster):
            job, index = name.split()
            logs[name] = (runner.logs(job, int(index)), runner.exit_code(job, int(index)))
    everything = "\n\n".join(f"===== {name} (exit {c})\n{log}" for name, (log, c) in logs.items())
    return logs, everything


@pytest.mark.parametrize(
    "has_chief, num_workers, victim",
    [
        (False, 4, "worker 0"),  # the first, and the coordinator's host
        (False, 4, "worker 2"),  # a middle one
        (False, 4, "worker 3"),  # the last
        (True, 4, "chief 0"),  # five tasks: the coordinator's host
        (True, 4, "worker 1"),
        (True, 4, "worker 3"),
    ],
)
def test_every_survivor_names_the_killed_task_and_none_aborts(has_chief, num_workers, victim):
    logs, everything = _lose_one(has_chief, num_workers, victim)
    assert logs[victim][1] == -9, everything  # (SIGKILL)
    for name, (log, code) in logs.items():
        if name == victim:
            continue
        assert f"SURVIVOR {name} UnavailableError" in log, everything
        assert f"Lost contact with {victim} during a collective" in log, everything
        assert "terminate called" not in log and "Terminating process" not in log, everything
        assert code == 1, everything


FROZEN_TIMEOUT = 10  # a frozen task is seen by the collective timeout: a short one


@pytest.mark.parametrize(
    "has_chief, num_workers, victim",
    [(False, 4, "worker 2"), (False, 4, "worker 0")],  # a middle one; the coordinator's host
)
def test_every_survivor_names_a_frozen_task_and_none_aborts(has_chief, num_workers, victim):
    # SIGSTOP: every thread of the task stops (its heartbeats and answers too), as a
    # machine that hangs; its sockets stay open, so no peer sees a connection drop.
    import signal

    logs, everything = _lose_one(has_chief, num_workers, victim, signal.SIGSTOP, FROZEN_TIMEOUT)
    for name, (log, code) in logs.items():
        if name == victim:
            continue
        survivor = [line for line in log.splitlines() if line.startswith(f"SURVIVOR {name} ")]
        assert survivor, everything
        # A frozen task is not known dead: TF's error for a stuck peer, naming it alone.
        assert f"SURVIVOR {name} DeadlineExceededError" in survivor[0], everything
        assert f": {victim} did not reach it (stuck or dead)" in survivor[0], everything
        assert "terminate called" not in log and "Terminating process" not in log, everything
        assert code == 1, everything
