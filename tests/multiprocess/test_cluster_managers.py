"""The strategies under real cluster managers: Slurm's ``srun`` and OpenMPI's ``mpirun``.

A one-node Slurm cluster of this module's own (``cluster_managers.SlurmCluster``: its own
slurmctld and slurmd, ports and directory) runs the ``srun`` steps; ``mpirun`` runs on this
machine. Every task runs ``cluster_manager_tasks.py`` and writes its results to a file.
MultiWorkerMirroredStrategy's ``fit`` on two tasks must equal one device's ``fit`` of the
same global batches from the same first weights (as in test_multi_worker.py), with the
resolver given, or found by ``resolve_cluster``; a parameter-server job must train and end
with its chief. A failure shows every task's log (and Slurm's daemons' logs).

Skipped, with the reason, when Slurm or OpenMPI is not installed (``.ci/run`` installs
them), when not root (Slurm's daemons), or when the hostname does not resolve to loopback.
"""

import json
import os
import secrets
import subprocess
import sys
from pathlib import Path

import cluster_managers as cm
import numpy as np
import pytest
from cluster_manager_tasks import BATCH
from cluster_manager_tasks import EPOCHS
from cluster_manager_tasks import PS_STEPS
from cluster_manager_tasks import ROWS
from cluster_manager_tasks import fixed_weights
from test_multi_worker import _flat
from test_multi_worker import _regression_data
from test_multi_worker import _tiny_model

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(400)]

TASKS = Path(__file__).with_name("cluster_manager_tasks.py")
TIMEOUT = 150  # seconds per srun / mpirun; then the job is cancelled and the test fails


@pytest.fixture(scope="module")
def slurm():
    """A one-node Slurm cluster for the module, stopped at its end."""
    reason = cm.slurm_skip_reason()
    if reason:
        pytest.skip(reason)
    try:
        cm.ensure_munged()
    except (OSError, RuntimeError, subprocess.SubprocessError) as error:
        pytest.skip(f"munged cannot start here: {error}")
    cluster = cm.SlurmCluster()
    try:
        cluster.start()
    except (OSError, RuntimeError, subprocess.SubprocessError) as error:
        cluster.stop()
        pytest.skip(f"slurmctld or slurmd cannot start here: {error}")
    yield cluster
    cluster.stop()


@pytest.fixture(scope="module")
def one_device():
    """Final weights and history of the tasks' fit on one device, without a strategy."""
    model = _tiny_model()
    model.set_weights(fixed_weights(model))
    x, y = _regression_data(ROWS)
    history = model.fit(x, y, batch_size=BATCH, epochs=EPOCHS, shuffle=False, verbose=0)
    return _flat(model.get_weights()), history.history


def _task_env(coordinator_port) -> dict:
    """One CPU device per task (not the 8 of this process), JAX's coordinator on loopback."""
    flags = os.environ.get("XLA_FLAGS", "").split()
    return {
        "XLA_FLAGS": " ".join(f for f in flags if "host_platform_device_count" not in f),
        "JAX_PLATFORMS": "cpu",
        "KERAS_BACKEND": "jax",
        "PYTHONUNBUFFERED": "1",
        "JAX_COORDINATOR_BIND_ADDRESS": f"127.0.0.1:{coordinator_port}",
    }


def _results(done, out_dir, count, report) -> list:
    """Each task's results file, by rank; the assertion message is ``report``."""
    assert done.returncode == 0, report
    paths = [out_dir / f"{rank}.json" for rank in range(count)]
    missing = [p.name for p in paths if not p.exists()]
    assert not missing, f"no results from {missing}\n{report}"
    return [json.loads(p.read_text()) for p in paths]


def _directories(tmp_path) -> tuple:
    """Where the tasks write their results, and their logs."""
    out_dir, log_dir = tmp_path / "out", tmp_path / "logs"
    out_dir.mkdir()
    log_dir.mkdir()
    return out_dir, log_dir


def _srun(slurm, tmp_path, ntasks, program, *args, env) -> tuple:
    """Runs ``cluster_manager_tasks.py PROGRAM OUT_DIR ARGS`` in ``ntasks`` srun tasks."""
    out_dir, log_dir = _directories(tmp_path)
    # --overcommit: more tasks than the machine's cores (the partition allows it).
    command = [f"--ntasks={ntasks}", "--overcommit", sys.executable, str(TASKS), program]
    command += [str(out_dir), *args]
    done = slurm.srun(command, log_dir=log_dir, env=env, timeout=TIMEOUT)
    report = (
        f"srun exited {done.returncode}:\n{done.stdout}\n{cm.task_logs(log_dir)}\n{slurm.logs()}"
    )
    return _results(done, out_dir, ntasks, report), report


def _assert_fit_equals_one_device(results, one_device, report) -> None:
    final, history = one_device
    assert [r["task"] for r in results] == [["worker", 0], ["worker", 1]], report
    assert [r["replicas"] for r in results] == [2, 2], report
    np.testing.assert_array_equal(results[0]["final"], results[1]["final"], err_msg=report)
    for result in results:
        np.testing.assert_allclose(result["final"], final, atol=1e-5, err_msg=report)
        assert sorted(result["history"]) == sorted(history), report
        for key, values in history.items():
            np.testing.assert_allclose(result["history"][key], values, rtol=1e-5, err_msg=report)


@pytest.mark.parametrize("resolver", ["explicit", "default"])
def test_srun_fit_on_two_tasks_equals_one_device(slurm, tmp_path, one_device, resolver):
    port = cm.free_port_range(2)
    env = _task_env(port)
    if resolver == "explicit":
        args = [str(port)]  # the task builds SlurmClusterResolver(port_base=port)
    else:
        args = []  # MultiWorkerMirroredStrategy() finds the Slurm step itself
        env["KERAS_DIST_SLURM_PORT_BASE"] = str(port)
    results, report = _srun(slurm, tmp_path, 2, "mwms", *args, env=env)
    cluster = {"worker": [f"{slurm.host}:{port}", f"{slurm.host}:{port + 1}"]}
    for result in results:
        assert result["resolver"] == "SlurmClusterResolver", report
        assert result["cluster"] == cluster, report
    _assert_fit_equals_one_device(results, one_device, report)


def test_srun_parameter_server_job_trains_and_ends_with_its_chief(slurm, tmp_path):
    port = cm.free_port_range(4)
    # Every task must share the token: the servers refuse requests without it.
    env = {**_task_env(port), "KERAS_DIST_CLUSTER_TOKEN": secrets.token_hex(16)}
    # srun returns only once every task has exited: the servers stopped when the chief ended.
    # TF's order: the jobs take the ranks by name, so rank 0 is the chief.
    (chief, ps, worker0, worker1), report = _srun(slurm, tmp_path, 4, "ps", str(port), env=env)
    host = slurm.host
    assert chief["cluster"] == {
        "chief": [f"{host}:{port}"],
        "ps": [f"{host}:{port + 1}"],
        "worker": [f"{host}:{port + 2}", f"{host}:{port + 3}"],
    }, report
    assert chief["task"] == ["chief", 0], report
    assert chief["devices"] == ["/job:ps/replica:0/task:0/device:CPU:0"], report
    assert chief["iterations"] == PS_STEPS, report
    assert chief["loss"][-1] < 0.2 * chief["loss"][0], report
    assert ps == {"task": ["ps", 0], "exit": 0}, report
    assert [worker0["task"], worker1["task"]] == [["worker", 0], ["worker", 1]], report
    # The chief's steps ran on the workers (fit sends each step to one of them).
    assert worker0["runs"] + worker1["runs"] >= PS_STEPS, report


@pytest.fixture(scope="module")
def openmpi():
    reason = cm.mpirun_skip_reason()
    if reason:
        pytest.skip(reason)


def test_mpirun_fit_on_two_ranks_with_the_default_resolver_equals_one_device(
    openmpi, tmp_path, one_device
):
    from keras_dist.cluster_resolver import OpenMPIClusterResolver

    out_dir, log_dir = _directories(tmp_path)
    port = cm.free_port_range(1)
    # The port derived from mpirun's job id may be taken on a busy machine: choose one.
    env = {**_task_env(port), "KERAS_DIST_COORDINATOR_PORT": str(port)}
    command = ["-n", "2", sys.executable, str(TASKS), "mwms", str(out_dir)]
    done = cm.mpirun(command, log_dir=log_dir, env=env, timeout=TIMEOUT)
    report = f"mpirun exited {done.returncode}:\n{done.stdout}\n{cm.task_logs(log_dir)}"
    results = _results(done, out_dir, 2, report)
    for result in results:
        assert result["resolver"] == "OpenMPIClusterResolver", report
        assert result["cluster"] == {"worker": [f"127.0.0.1:{port}", ""]}, report
    _assert_fit_equals_one_device(results, one_device, report)
    # Without the chosen port, the real URI gives the port derived from mpirun's job id.
    uri = results[0]["hnp_uri"]
    derived = 61440 + (int(uri.split(".")[0]) >> 16) % 4096  # the job family's low 12 bits
    rank = {"OMPI_COMM_WORLD_SIZE": "2", "OMPI_COMM_WORLD_RANK": "0", "OMPI_MCA_orte_hnp_uri": uri}
    assert OpenMPIClusterResolver(environ=rank).coordinator_address == f"127.0.0.1:{derived}"
