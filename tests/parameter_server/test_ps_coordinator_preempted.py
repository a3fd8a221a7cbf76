"""The coordinator (the chief) is SIGTERMed mid-``fit`` and the job is started again.

A chief, one worker and one ps run as real processes. With
``BackupAndRestore(save_before_preemption=True)`` the chief saves at the next step and
exits with 42; the ps and worker tasks are stopped with it. The job started again (new
processes, an empty ps) resumes from the backup and ends with the iterations and weights
of an uninterrupted run (one worker: its steps run in order, so the numbers are exact).
"""

import os
import signal
import time

import numpy as np
import pytest

import keras_dist as kd
from keras_dist import testing

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(400)]

EPOCHS, ROWS, BATCH = 3, 128, 16  # 8 steps an epoch
TOKEN = {"KERAS_DIST_CLUSTER_TOKEN": "coordinator-preempted"}


def _job(directory, interrupt):
    import keras

    resolver = kd.cluster_resolver.TFConfigClusterResolver()
    if resolver.task_type in ("worker", "ps"):
        # Serve until the job ends (the launcher stops these tasks with the chief).
        kd.Server(resolver, job_name=resolver.task_type, task_index=resolver.task_id).join()
        return None
    strategy = kd.ParameterServerStrategy(resolver)
    rng = np.random.default_rng(0)
    x = rng.normal(size=(ROWS, 8)).astype("float32")
    y = (x @ rng.normal(size=(8, 1))).astype("float32")
    keras.utils.set_random_seed(3)
    with strategy.scope():
        model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(4), keras.layers.Dense(1)])
        model.compile(keras.optimizers.SGD(0.02, momentum=0.9), "mse")

    class SignalMidFit(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            step = int(model.optimizer.iterations.numpy())
            if interrupt and step >= 11:
                open(os.path.join(directory, "mid-fit"), "a").close()
                time.sleep(0.3)  # leaves the test time to send SIGTERM

    backup = kd.callbacks.BackupAndRestore(
        os.path.join(directory, "backup"), save_freq=5, save_before_preemption=True
    )
    history = model.fit(
        x,
        y,
        batch_size=BATCH,
        epochs=EPOCHS,
        shuffle=False,
        verbose=0,
        callbacks=[backup, SignalMidFit()],
    )
    return {
        "iterations": int(model.optimizer.iterations.numpy()),
        "weights": [w.tolist() for w in model.get_weights()],
        "epochs": history.epoch,
    }


def _launch(directory):
    return kd.launch(
        _job,
        num_workers=1,
        has_chief=True,
        num_ps=1,
        args=(str(directory), False),
        env=TOKEN,
        timeout=180,
        stream_output=False,
    )[0]


def test_a_sigtermed_coordinator_resumes_to_the_uninterrupted_weights(tmp_path):
    uninterrupted = _launch(tmp_path / "uninterrupted")
    assert uninterrupted["iterations"] == EPOCHS * ROWS // BATCH

    directory = tmp_path / "interrupted"
    directory.mkdir()
    cluster = testing.create_cluster_spec(has_chief=True, num_workers=1, num_ps=1)
    runner = testing.MultiProcessRunner(
        _job, cluster, args=(str(directory), True), env=TOKEN, stream_output=False
    )
    with runner:
        runner.start()
        deadline = time.monotonic() + 120
        while not (directory / "mid-fit").exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        os.kill(runner.process_status()[("chief", 0)].pid, signal.SIGTERM)
        with pytest.raises(testing.UnexpectedSubprocessExitError):
            runner.join(timeout=120)
        code, log = runner.exit_code("chief", 0), runner.logs("chief", 0)
    assert code == 42, log  # saved at the next step, then exited for a restart
    assert (directory / "backup" / "chief").exists()

    resumed = _launch(directory)
    assert resumed["iterations"] == uninterrupted["iterations"]
    assert resumed["epochs"][0] == 1  # resumed inside epoch 1, not from the start
    for got, want in zip(resumed["weights"], uninterrupted["weights"]):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-6, atol=1e-6)
