"""Elastic jobs: a worker gone for good, and the job goes on with the workers it has.

Three workers fit with ``BackupAndRestore``; worker 2 dies mid-epoch, and when the
cluster starts again it dies at once (its machine is gone). The launcher then runs
the job on 2 workers, which resume from the backup with the same global batch: the
optimizer counts exactly epochs x steps, and the weights are one device's on the same
global batches (MultiWorkerMirroredStrategy's numbers do not depend on the worker count).
"""

import json
import os
import textwrap

import numpy as np
import pytest
from elastic_reference import assert_resumed_as_one_device
from elastic_reference import fit_with_backup
from elastic_reference import small_model

import keras_dist as kd
from keras_dist._launch._cli import main as cli_main

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(400)]


def _elastic_worker(directory):
    import keras

    task = json.loads(os.environ["TF_CONFIG"])["task"]
    machine_gone = os.path.join(directory, "machine-2-gone")
    if task["index"] == 2 and os.path.exists(machine_gone):
        os._exit(17)  # the machine never comes back
    strategy = kd.MultiWorkerMirroredStrategy(
        communication_options=kd.experimental.CommunicationOptions(timeout_seconds=30)
    )
    keras.utils.set_random_seed(7)
    with strategy.scope():
        model = small_model()
    initial = os.path.join(directory, "initial.npy")
    if strategy.cluster_resolver.task_id == 0 and not os.path.exists(initial):
        np.save(initial, np.concatenate([np.ravel(w) for w in model.get_weights()]))

    class Record(keras.callbacks.Callback):
        """Worker 2 dies in epoch 2; every epoch notes how many workers ran it."""

        def on_train_batch_end(self, batch, logs=None):
            if task["index"] == 2 and self._epoch == 2 and batch == 3:
                open(machine_gone, "w").close()
                os._exit(13)

        def on_epoch_begin(self, epoch, logs=None):
            self._epoch = epoch

        def on_epoch_end(self, epoch, logs=None):
            logs["workers"] = strategy.extended.num_workers

    return fit_with_backup(model, directory, Record())


def test_a_worker_gone_for_good_leaves_the_job_on_two_workers(tmp_path, capsys):
    results = kd.launch(
        _elastic_worker,
        num_workers=3,
        min_workers=2,
        max_restarts=2,
        args=(str(tmp_path),),
        timeout=300,
        failure_grace=5,
    )
    out = capsys.readouterr().out
    assert len(results) == 2, out  # the job finished on 2 workers
    assert "continuing without that machine, on 2 workers (min 2; restart 2 of 2)" in out
    assert_resumed_as_one_device(results, tmp_path)


def _machine_2_is_broken():
    task = json.loads(os.environ["TF_CONFIG"])["task"]
    if task["index"] == 2:
        os._exit(17)
    return task["index"]


def test_the_job_fails_when_fewer_than_min_workers_would_remain():
    # min_workers=3: the broken machine cannot be left out, and the restarts run out.
    with pytest.raises(kd.testing.UnexpectedSubprocessExitError, match="worker 2"):
        kd.launch(
            _machine_2_is_broken,
            num_workers=3,
            min_workers=3,
            max_restarts=1,
            timeout=60,
            failure_grace=1,
            stream_output=False,
        )


def test_min_workers_and_the_worker_range_are_checked(capsys):
    with pytest.raises(ValueError, match=r"from 1 to the number of workers \(2\)"):
        kd.launch(print, num_workers=2, min_workers=3)
    with pytest.raises(SystemExit):
        cli_main(["launch", "--workers", "4:2", "train.py"])
    assert "MIN must not exceed MAX, got 4:2" in capsys.readouterr().err


def test_the_command_shrinks_within_its_worker_range(tmp_path, capsys):
    script = tmp_path / "train.py"
    script.write_text(
        "import json, os, sys\n"
        "task = json.loads(os.environ['TF_CONFIG'])\n"
        "workers = len(task['cluster']['worker'])\n"
        "print(f\"worker {task['task']['index']} of {workers}\", flush=True)\n"
        "sys.exit(3 if task['task']['index'] == 2 else 0)  # machine 2 is broken\n"
    )
    code = cli_main(
        ["launch", "--workers", "2:3", "--max-restarts", "2", "--grace", "1", str(script)]
    )
    out = capsys.readouterr().out
    assert code == 0, out
    assert "continuing without that machine, on 2 workers (min 2; restart 2 of 2)" in out
    assert out.count("[worker 1] worker 1 of 3") == 2 and "[worker 1] worker 1 of 2" in out


# Machine m (its worker sees m + 1 devices) says which worker it is. On 4 machines, machine 1
# is lost mid-run: SIGKILLed once the others hold a connection to it; they then fail, as a
# collective's peers do, with keras_dist's error naming it. Started again, it dies at once.
# On fewer machines the job succeeds.
_LOSE_MACHINE_1 = textwrap.dedent(
    """
    import json, os, signal, socket, sys, time

    class UnavailableError(RuntimeError):
        "keras_dist.errors.UnavailableError's name (importing keras_dist takes seconds)."

    config = json.loads(os.environ["TF_CONFIG"])
    index, workers = config["task"]["index"], config["cluster"]["worker"]
    machine = int(os.environ["XLA_FLAGS"].rpartition("=")[2]) - 1
    print(f"machine {machine} is worker {index} of {len(workers)}", flush=True)
    gone = os.path.join(os.path.dirname(os.path.abspath(__file__)), "machine-1-gone")
    if machine == 1 and os.path.exists(gone):
        os.kill(os.getpid(), signal.SIGKILL)
    if len(workers) < 4:
        sys.exit(0)
    host, port = workers[1].rsplit(":", 1)
    if machine == 1:
        server = socket.create_server((host, int(port)))
        peers = [server.accept()[0] for _ in range(3)]
        open(gone, "w").close()
        os.kill(os.getpid(), signal.SIGKILL)
    deadline = time.monotonic() + 30
    while True:
        try:
            peer = socket.create_connection((host, int(port)))
            break
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)
    peer.recv(1)  # b"" once machine 1 is gone
    raise UnavailableError("Lost contact with worker 1 during a collective: the task died.")
    """
)


def test_a_machine_killed_mid_run_is_left_out_at_the_next_attempt(tmp_path, capsys):
    script = tmp_path / "train.py"
    script.write_text(_LOSE_MACHINE_1)
    code = cli_main(
        ["launch", "--workers", "2:4", "--max-restarts", "2", "--grace", "5"]
        + ["--devices-per-worker", "1,2,3,4", str(script)]
    )
    out = capsys.readouterr().out
    assert code == 0, out
    # Machine 1 (worker 1) is blamed, not worker 0 that failed after it, and left out at
    # once: the second attempt runs on the other three machines, and succeeds.
    assert (
        "[keras-dist] worker 1 exited unexpectedly (killed by SIGKILL): continuing without "
        "that machine, on 3 workers (min 2; restart 1 of 2)." in out
    )
    attempts = [line.partition("] ")[2] for line in out.splitlines() if " is worker " in line]
    first = [f"machine {m} is worker {m} of 4" for m in range(4)]
    second = [f"machine {m} is worker {i} of 3" for i, m in enumerate([0, 2, 3])]
    assert sorted(attempts) == sorted(first + second), out
