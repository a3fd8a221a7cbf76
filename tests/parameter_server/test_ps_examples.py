"""The parameter-server examples run: the notebook (in-process cluster), the launched script,
and ``kd.launch`` with ps tasks."""

import os
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

import keras_dist as kd

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"

pytestmark = pytest.mark.timeout(300)


def _outputs(notebook) -> str:
    return "".join(
        output.get("text", "")
        for cell in notebook.cells
        if cell.cell_type == "code"
        for output in cell.get("outputs", [])
    )


def test_parameter_server_notebook_runs(tmp_path):
    notebook = nbformat.read(EXAMPLES / "parameter_server.ipynb", as_version=4)
    NotebookClient(
        notebook, timeout=300, kernel_name="python3", resources={"metadata": {"path": tmp_path}}
    ).execute()
    outputs = _outputs(notebook)
    assert "optimizer iterations: 100" in outputs  # 5 epochs × 20 steps, none lost
    assert "loss fell: True" in outputs
    assert "checkpoint saved: True" in outputs
    assert "Finished epoch 3, accuracy is" in outputs
    assert "optimizer iterations: 20" in outputs  # the custom loop's 4 × 5 steps
    assert "examples evaluated: 512" in outputs


@pytest.mark.multiprocess
def test_fit_example_runs_through_keras_dist_launch():
    env = dict(os.environ, EPOCHS="2")
    env.pop("XLA_FLAGS", None)
    command = [sys.executable, "-m", "keras_dist._launch._cli", "launch", "--chief", "--ps", "1"]
    command += ["--workers", "2", "--timeout", "240", str(EXAMPLES / "parameter_server_fit.py")]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=280)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "[chief 0] optimizer iterations: 48 (expected 48)" in done.stdout
    assert "/job:ps/replica:0/task:0/device:CPU:0" in done.stdout


def _between_graph_counter():
    import keras

    import keras_dist as kd

    strategy = kd.ParameterServerStrategy()
    with strategy.scope():
        counter = keras.Variable(0.0)
    for _ in range(10):
        counter.assign_add(1.0)
    return strategy.extended.worker_index


@pytest.mark.multiprocess
def test_launch_with_ps_tasks_returns_the_workers_results():
    results = kd.launch(
        _between_graph_counter, num_workers=2, num_ps=1, stream_output=False, timeout=120
    )
    assert results == [0, 1]
