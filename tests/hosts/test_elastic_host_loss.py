"""An elastic job on hosts of their own loses a host for good, and goes on with the rest.

``kd.launch`` starts three workers, one on each of three hosts (network namespaces with
their own addresses, reached through ``host_command`` as ``ssh {host}`` would reach
them). Mid-epoch 2, host 2's link is cut and stays cut: its worker is alive but no
packet of it reaches anyone. The survivors name worker 2; the launcher leaves host 2
out and starts the job again on hosts 0 and 1, which resume from ``BackupAndRestore``'s
backup with the same global batch. The optimizer counts exactly epochs x steps and the
weights are one device's on the same global batches.
"""

import os
import pathlib
import threading
import time

import netns_hosts
import numpy as np
import pytest
from elastic_reference import assert_resumed_as_one_device
from elastic_reference import fit_with_backup
from elastic_reference import small_model

import keras_dist as kd

pytestmark = [
    pytest.mark.multiprocess,
    pytest.mark.timeout(420),
    pytest.mark.skipif(
        netns_hosts.skip_reason() is not None, reason=str(netns_hosts.skip_reason())
    ),
]

CUT_EPOCH, CUT_BATCH = 2, 3
# Seconds from the cut to the job's end: the survivors' collective timeout (10 s) and
# their exit, the launcher's grace for the cut-off worker (5 s), and a restart on two
# hosts (JAX's start and 2 epochs: ~40 s on 2 loaded cores).
RECOVERY_BOUND = 150


def _worker_on_a_host(directory):
    import keras

    directory = pathlib.Path(directory)
    strategy = kd.MultiWorkerMirroredStrategy(
        communication_options=kd.experimental.CommunicationOptions(timeout_seconds=10)
    )
    task_id = strategy.cluster_resolver.task_id
    keras.utils.set_random_seed(7)
    with strategy.scope():
        model = small_model()
    initial = directory / "initial.npy"
    if task_id == 0 and not initial.exists():
        np.save(initial, np.concatenate([np.ravel(w) for w in model.get_weights()]))

    class Pace(keras.callbacks.Callback):
        """Says when the cut's batch ended; paces the steps so that the cut falls mid-epoch."""

        def on_epoch_begin(self, epoch, logs=None):
            self._epoch = epoch

        def on_train_batch_end(self, batch, logs=None):
            if (self._epoch, batch) == (CUT_EPOCH, CUT_BATCH) and task_id == 0:
                (directory / "cut-now.mark").touch()
            if self._epoch == CUT_EPOCH:
                time.sleep(0.3)

        def on_epoch_end(self, epoch, logs=None):
            logs["workers"] = strategy.extended.num_workers

    return {"host": os.uname().nodename, **fit_with_backup(model, directory, Pace())}


def _cut_when_told(hosts, directory, cut, stop):
    while not stop.is_set():
        if (directory / "cut-now.mark").exists():
            hosts.cut(2)
            cut.append(time.time())
            return
        time.sleep(0.05)


def test_an_elastic_job_that_loses_a_host_for_good_goes_on_with_the_rest(tmp_path, capsys):
    with netns_hosts.NetnsHosts(3) as hosts:
        cut, stop = [], threading.Event()
        cutter = threading.Thread(target=_cut_when_told, args=(hosts, tmp_path, cut, stop))
        cutter.start()
        try:
            results = kd.launch(
                _worker_on_a_host,
                num_workers=3,
                min_workers=2,
                max_restarts=2,
                args=(str(tmp_path),),
                timeout=360,
                failure_grace=5,
                hosts=hosts.addresses,
                host_command=hosts.host_command(tmp_path),
                # The launcher simulates no devices: one CPU device a task.
                env={"XLA_FLAGS": "--xla_force_host_platform_device_count=1"},
            )
        finally:
            stop.set()
            cutter.join()
        ended = time.time()
    out = capsys.readouterr().out
    print(out)
    assert cut, "the cut's batch never ended"
    print(f"the job ended {ended - cut[0]:.1f} s after the cut")
    assert ended - cut[0] < RECOVERY_BOUND
    assert "continuing without that machine, on 2 workers (min 2; restart 1 of 2)" in out
    assert [r["host"] for r in results] == ["host0", "host1"]  # host 2 left out
    assert_resumed_as_one_device(results, tmp_path)
