"""The example notebooks run from top to bottom (so they never rot)."""

from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def _outputs(notebook) -> str:
    return "".join(
        output.get("text", "")
        for cell in notebook.cells
        if cell.cell_type == "code"
        for output in cell.get("outputs", [])
    )


def test_quickstart_notebook_runs(tmp_path, monkeypatch):
    # The kernel inherits the environment: its own 4 simulated devices.
    monkeypatch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=4")
    notebook = nbformat.read(EXAMPLES / "quickstart.ipynb", as_version=4)
    NotebookClient(
        notebook, timeout=300, kernel_name="python3", resources={"metadata": {"path": tmp_path}}
    ).execute()
    outputs = _outputs(notebook)
    assert "4 replicas" in outputs
    assert "MirroredVariable" in outputs
    assert "CentralStorageStrategy" in outputs


@pytest.mark.multiprocess
def test_multi_worker_notebook_launches_two_workers(tmp_path):
    notebook = nbformat.read(EXAMPLES / "multi_worker.ipynb", as_version=4)
    NotebookClient(
        notebook, timeout=300, kernel_name="python3", resources={"metadata": {"path": tmp_path}}
    ).execute()
    outputs = _outputs(notebook)
    assert "worker 0 of 2 replicas" in outputs and "worker 1 of 2 replicas" in outputs
    assert "identical weights on both workers: True" in outputs
    assert "checkpoint files: ['model.keras']" in outputs


@pytest.fixture(autouse=True)
def _kernel_available():
    from jupyter_client.kernelspec import KernelSpecManager

    assert "python3" in KernelSpecManager().find_kernel_specs(), "ipykernel is not installed"
