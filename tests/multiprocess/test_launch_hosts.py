"""Tasks placed on hosts through ``host_command``, here with hosts that are this machine.

``env KD_ON_HOST={host}`` stands in for ``ssh {host}``: a prefix that starts the rest,
which tells the task where it was sent. Every address is a loopback one (127.0.0.x all
reach this machine). Hosts with their own network: ``tests/hosts``.
"""

import os
import subprocess
import sys
import time

import pytest

import keras_dist as kd
from keras_dist._launch._hosts import unreachable_hosts

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(240)]

HOST_COMMAND = "env KD_ON_HOST={host}"
_LAUNCH = [sys.executable, "-m", "keras_dist._launch._cli", "launch", "--workers", "2"]
TRICKY = 'a value with spaces, "quotes", $HOME and ; & | {}'


def _where_am_i():
    import json
    import os

    config = json.loads(os.environ["TF_CONFIG"])
    task = config["task"]
    return {
        "host": os.environ["KD_ON_HOST"],
        "address": config["cluster"][task["type"]][task["index"]],
        "tricky": os.environ["KD_TRICKY"],
        "parent_alive": os.getppid() != 1,
    }


def test_each_task_runs_through_the_host_command_on_its_own_address():
    results = kd.launch(
        _where_am_i,
        num_workers=2,
        has_chief=True,
        hosts=["127.0.0.1", "127.0.0.2", "127.0.0.3"],
        host_command=HOST_COMMAND,
        env={"KD_TRICKY": TRICKY},
        stream_output=False,
        timeout=120,
    )
    assert [r["host"] for r in results] == ["127.0.0.1", "127.0.0.2", "127.0.0.3"]
    for result in results:
        assert result["address"].startswith(result["host"] + ":")
        assert result["tricky"] == TRICKY  # through the encoded word, whole
        assert result["parent_alive"]


def test_a_multi_worker_fit_on_two_loopback_hosts_agrees():
    def fit():
        import keras
        import numpy as np

        import keras_dist as kd

        strategy = kd.MultiWorkerMirroredStrategy()
        keras.utils.set_random_seed(strategy.cluster_resolver.task_id)
        with strategy.scope():
            model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
            model.compile("sgd", "mse")
        x = np.arange(48, dtype="float32").reshape(16, 3) / 48
        model.fit(x, x.sum(1), batch_size=8, epochs=2, verbose=0)
        return [w.tolist() for w in model.get_weights()]

    results = kd.launch(
        fit,
        num_workers=2,
        hosts=["127.0.0.1", "127.0.0.2"],
        host_command=HOST_COMMAND,
        stream_output=False,
        timeout=180,
    )
    assert results[0] == results[1]


def test_a_task_on_a_host_dies_with_the_launcher_that_started_it(tmp_path):
    script = tmp_path / "sleeper.py"
    script.write_text(
        "import os, pathlib, sys, time\n"
        "pathlib.Path(sys.argv[1], f'{os.getpid()}.pid').touch()\n"
        "time.sleep(600)\n"
    )
    launcher = subprocess.Popen(_on_two_hosts(str(script), str(tmp_path)))
    try:
        deadline = time.monotonic() + 120
        while len(pids := [int(p.stem) for p in tmp_path.glob("*.pid")]) < 2:
            assert time.monotonic() < deadline, "the tasks never started"
            time.sleep(0.1)
    finally:
        launcher.kill()  # SIGKILL: the launcher cannot stop its tasks itself
        launcher.wait()
    deadline = time.monotonic() + 10
    while any(_alive(pid) for pid in pids):
        assert time.monotonic() < deadline, f"tasks {pids} outlived their launcher"
        time.sleep(0.1)


def _on_two_hosts(*script_and_arguments):
    hosts = ["--hosts", "127.0.0.1,127.0.0.2", "--host-command", HOST_COMMAND]
    return [*_LAUNCH, *hosts, *script_and_arguments]


def _alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_hosts_that_answer_are_not_unreachable():
    # A refused connection is an answer: every loopback host reaches every other.
    addresses = ["127.0.0.1:9", "127.0.0.2:9", "127.0.0.3:9"]
    assert unreachable_hosts(HOST_COMMAND, addresses, timeout=2.0) == set()


@pytest.mark.parametrize(
    "arguments, message",
    [
        (["--hosts", "127.0.0.1"], "one address per task (2"),
        (["--hosts", "127.0.0.1,127.0.0.2"], "need `host_command`"),
        (["--host-command", "ssh {host}"], "no hosts were given"),
        (["--hosts", "127.0.0.1,127.0.0.2", "--host-command", "ssh"], "need `host_command`"),
    ],
)
def test_the_command_refuses_hosts_that_do_not_fit(tmp_path, arguments, message):
    script = tmp_path / "train.py"
    script.write_text("print('never')\n")
    done = subprocess.run(
        [*_LAUNCH, *arguments, str(script)], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 2, done.stderr
    assert message in done.stderr
    assert "never" not in done.stdout


def test_the_command_runs_a_script_on_its_hosts(tmp_path):
    script = tmp_path / "where.py"
    script.write_text(
        "import json, os\n"
        "task = json.loads(os.environ['TF_CONFIG'])['task']\n"
        "print('on', os.environ['KD_ON_HOST'], task['index'])\n"
    )
    done = subprocess.run(_on_two_hosts(str(script)), capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "[worker 0] on 127.0.0.1 0" in done.stdout
    assert "[worker 1] on 127.0.0.2 1" in done.stdout
