"""`ProcessRole`: which task this process is, and whether it is the chief.

The one place keras_dist decides who the chief is (TF's rule: the ``chief``
task, else worker 0, and an evaluator for itself). Strategies answer
``extended.role`` with it; callbacks ask it where to write files: the chief at
the path it was given, the others into a ``workertemp_<task_id>`` directory
that they remove right after (tf.distribute's ``distributed_file_utils``).
"""

from typing import NamedTuple

import jax

from keras_dist.cluster_resolver import _multi_worker
from keras_dist.cluster_resolver._cluster_spec import ClusterSpec


class ProcessRole(NamedTuple):
    """This process's task in its cluster; all ``None`` for a single process.

    >>> ProcessRole().is_chief
    True
    >>> ProcessRole("worker", 1, ClusterSpec({"worker": ["a:1", "b:1"]})).is_chief
    False
    """

    task_type: "str | None" = None
    task_id: "int | None" = None
    cluster_spec: "ClusterSpec | None" = None

    @property
    def is_chief(self) -> bool:
        """Whether this process writes checkpoints and summaries at the user's paths."""
        return _multi_worker.should_checkpoint(self.cluster_spec, self.task_type, self.task_id)

    def write_filepath(self, filepath: str) -> str:
        """``filepath`` on the chief, ``<dir>/workertemp_<task_id>/<name>`` elsewhere."""
        return _multi_worker.write_filepath(
            filepath, self.task_type, self.task_id, self.cluster_spec
        )

    def write_dirpath(self, dirpath: str) -> str:
        """``dirpath`` on the chief, ``<dirpath>/workertemp_<task_id>`` (created) elsewhere."""
        return _multi_worker.write_dirpath(dirpath, self.task_type, self.task_id, self.cluster_spec)

    def remove_temp_dirpath(self, dirpath: str) -> None:
        """Deletes a non-chief's temp dir for ``dirpath``; nothing on the chief."""
        _multi_worker.remove_temp_dirpath(dirpath, self.task_type, self.task_id, self.cluster_spec)

    def remove_orphaned_temp_dirs(self, dirpath: str) -> None:
        """On the chief: removes temp dirs in ``dirpath`` of tasks not in this job."""
        _multi_worker.remove_orphaned_temp_dirs(
            dirpath, self.task_type, self.task_id, self.cluster_spec
        )

    def remove_temp_dir_with_filepath(self, filepath: str) -> None:
        """Deletes a non-chief's temp dir holding ``filepath``; nothing on the chief."""
        _multi_worker.remove_temp_dir_with_filepath(
            filepath, self.task_type, self.task_id, self.cluster_spec
        )


def role_from_resolver(resolver=None) -> ProcessRole:
    """The role a cluster resolver gives this process.

    Without a resolver, a job of several JAX processes (``jax.distributed``
    started by hand) still needs one writer: process 0 is the chief.

    >>> role_from_resolver(None).is_chief
    True
    """
    spec = ClusterSpec(resolver.cluster_spec()) if resolver is not None else None
    if spec:
        return ProcessRole(resolver.task_type, resolver.task_id, spec)
    if jax.process_count() > 1:
        workers = [f"process{i}" for i in range(jax.process_count())]
        return ProcessRole("worker", jax.process_index(), ClusterSpec({"worker": workers}))
    return ProcessRole()
