"""Local multi-process launching: ``launch``, ``MultiProcessRunner`` and ``keras-dist launch``.

``keras_dist.launch`` and the ``keras-dist`` command are the user-facing entry points;
``keras_dist.testing`` re-exports the runner and the cluster helpers for tests.
"""

from keras_dist._launch._cluster import create_cluster_spec as create_cluster_spec
from keras_dist._launch._cluster import pick_unused_port as pick_unused_port
from keras_dist._launch._errors import SubprocessTimeoutError as SubprocessTimeoutError
from keras_dist._launch._errors import (
    UnexpectedSubprocessExitError as UnexpectedSubprocessExitError,
)
from keras_dist._launch._errors import WorkerError as WorkerError
from keras_dist._launch._launcher import launch as launch
from keras_dist._launch._runner import MultiProcessRunner as MultiProcessRunner
from keras_dist._launch._task_slot import TaskStatus as TaskStatus

__all__ = [
    "MultiProcessRunner",
    "SubprocessTimeoutError",
    "TaskStatus",
    "UnexpectedSubprocessExitError",
    "WorkerError",
    "create_cluster_spec",
    "launch",
    "pick_unused_port",
]
