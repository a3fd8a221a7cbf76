"""Who is the chief, worker counts and ids, and where non-chiefs write files.

The functions of TF's ``multi_worker_util`` and tf-keras's
``distributed_file_utils``, on a ``ClusterSpec`` (or dict) and this task's
``task_type`` and ``task_id``, with TF's error messages.
"""

import contextlib
import os
import re
import shutil

from keras_dist.cluster_resolver._cluster_spec import ClusterSpec
from keras_dist.cluster_resolver._cluster_spec import is_cluster

_ALLOWED_TASK_TYPES = ("chief", "worker", "evaluator", "ps", None)


def _normalize(cluster_spec):
    if cluster_spec is None:
        return ClusterSpec({})
    if is_cluster(cluster_spec):
        return ClusterSpec(cluster_spec)
    raise ValueError(
        "`cluster_spec` should be a dict, a `ClusterSpec` or a `tf.train.ClusterSpec`. "
        f"Received: cluster_spec={cluster_spec!r}"
    )


def _task_count(spec, task_type):
    return spec.num_tasks(task_type) if task_type in spec.jobs else 0


def _validate(cluster_spec, task_type, task_id):
    spec = _normalize(cluster_spec)
    if any(job not in _ALLOWED_TASK_TYPES for job in spec.jobs):
        raise ValueError(
            f"Disallowed task type found in cluster spec. Allowed types are "
            f"{_ALLOWED_TASK_TYPES} and the cluster spec is {spec}."
        )
    if task_type not in _ALLOWED_TASK_TYPES:
        raise ValueError(
            f"Unrecognized task_type: {task_type}, valid task types are: {_ALLOWED_TASK_TYPES}"
        )
    # The evaluator may run outside the cluster it evaluates.
    if task_type and task_type not in spec.jobs and task_type != "evaluator":
        raise ValueError(f"`task_type` {task_type!r} not found in cluster_spec.")
    if _task_count(spec, "chief") > 1:
        raise ValueError("There must be at most one 'chief' job.")
    if _task_count(spec, "evaluator") > 1:
        raise ValueError("There must be at most one 'evaluator' job.")
    if task_type in spec.jobs and task_id >= spec.num_tasks(task_type):
        raise ValueError(f"The `task_id` {task_id} exceeds the maximum id of {task_type}.")
    return spec


def is_chief(cluster_spec=None, task_type=None, task_id=None):
    """Whether the task is the chief: ``chief`` (or worker 0 when there is none), or an evaluator.

    >>> is_chief({"chief": ["c:1"], "worker": ["w0:1"]}, "worker", 0)
    False
    >>> is_chief({"worker": ["w0:1", "w1:1"]}, "worker", 0)
    True
    """
    spec = _validate(cluster_spec, task_type, task_id)
    if task_type in ("chief", "evaluator"):
        return True
    # Without a chief job, worker 0 is the chief (as in MultiWorkerMirroredStrategy).
    return "chief" not in spec.jobs and task_type == "worker" and task_id == 0


def worker_count(cluster_spec, task_type):
    """The number of workers (chief included) in the collective of ``task_type``.

    An evaluator is in its own cluster, so it counts only evaluators.

    >>> worker_count({"chief": ["c:1"], "worker": ["w0:1", "w1:1"]}, "worker")
    3
    """
    spec = _validate(cluster_spec, task_type, task_id=0)
    if task_type not in ("chief", "worker", "evaluator"):
        raise ValueError(f"Unexpected `task_type` {task_type!r}")
    if task_type == "evaluator":
        # TF fails with a KeyError for an evaluator outside the spec; it is one task alone.
        return _task_count(spec, "evaluator") or 1
    return _task_count(spec, "chief") + _task_count(spec, "worker")


def id_in_cluster(cluster_spec, task_type, task_id):
    """The task's rank among the chief and workers: the chief is 0, workers follow.

    >>> id_in_cluster({"chief": ["c:1"], "worker": ["w0:1", "w1:1"]}, "worker", 1)
    2
    """
    spec = _validate(cluster_spec, task_type, task_id)
    if task_type == "chief":
        return 0
    if task_type == "worker":
        return task_id + _task_count(spec, "chief")
    if task_type == "evaluator":
        return task_id
    raise ValueError(f"There is no id for task_type {task_type!r}")


def collective_leader(cluster_spec, task_type, task_id):
    """The device name of the collective's leader; ``""`` for a local run or an evaluator.

    >>> collective_leader({"worker": ["w0:1", "w1:1"]}, "worker", 1)
    '/job:worker/replica:0/task:0'
    >>> collective_leader({}, None, 0)
    ''
    """
    spec = _normalize(cluster_spec)
    if not spec:
        return ""
    _validate(spec, task_type, task_id)
    if task_type == "evaluator":
        return ""
    if "chief" in spec.jobs:
        return "/job:chief/replica:0/task:0"
    return "/job:worker/replica:0/task:0"


def _require_task(cluster_spec, task_type, task_id):
    spec = _normalize(cluster_spec)
    if spec and (task_type is None or task_id is None):
        raise ValueError(
            "When `cluster_spec` is given, you must also specify `task_type` and `task_id`. "
            f"Received: task_type={task_type!r}, task_id={task_id!r}"
        )
    return spec


def should_init(cluster_spec=None, task_type=None, task_id=None):
    """Whether the task initializes variables: every worker does in a collective cluster.

    >>> should_init({"worker": ["w0:1", "w1:1"]}, "worker", 1)
    True
    """
    _require_task(cluster_spec, task_type, task_id)
    return True


def should_checkpoint(cluster_spec=None, task_type=None, task_id=None):
    """Whether the task saves checkpoints: only the chief (or a single process) does.

    >>> should_checkpoint({"worker": ["w0:1", "w1:1"]}, "worker", 1)
    False
    """
    spec = _require_task(cluster_spec, task_type, task_id)
    return not spec or is_chief(spec, task_type, task_id)


def should_save_summary(cluster_spec=None, task_type=None, task_id=None):
    """Whether the task writes summaries: as ``should_checkpoint``, only the chief.

    >>> should_save_summary({"worker": ["w0:1", "w1:1"]}, "worker", 0)
    True
    """
    return should_checkpoint(cluster_spec, task_type, task_id)


_TEMP_DIR = re.compile(r"workertemp_\d+")


def _temp_dirname(task_id):
    return f"workertemp_{task_id}"


def _temp_dir(dirpath, task_id):
    # Given the temp dir itself, do not nest a second one in it.
    if dirpath.endswith(_temp_dirname(task_id)):
        return dirpath
    return os.path.join(dirpath, _temp_dirname(task_id))


def write_dirpath(dirpath, task_type=None, task_id=None, cluster_spec=None):
    """Where the task writes ``dirpath``: itself on the chief, else ``dirpath/workertemp_<id>``.

    Non-chiefs must still write (saving may involve collectives) but into a
    directory of their own, created here and removed by ``remove_temp_dirpath``.

    >>> write_dirpath("/tmp/ckpt", "worker", 0, {"worker": ["w0:1", "w1:1"]})
    '/tmp/ckpt'
    """
    if should_checkpoint(cluster_spec, task_type, task_id):
        return dirpath
    temp_dir = _temp_dir(dirpath, task_id)
    os.makedirs(temp_dir, exist_ok=True)
    return temp_dir


def write_filepath(filepath, task_type=None, task_id=None, cluster_spec=None):
    """Where the task writes ``filepath``: itself on the chief, else in ``workertemp_<id>``.

    >>> write_filepath("/tmp/ckpt/model.keras", "chief", 0, {"chief": ["c:1"], "worker": ["w0:1"]})
    '/tmp/ckpt/model.keras'
    """
    dirpath, base = os.path.split(filepath)
    return os.path.join(write_dirpath(dirpath, task_type, task_id, cluster_spec), base)


def remove_temp_dirpath(dirpath, task_type=None, task_id=None, cluster_spec=None):
    """Deletes a non-chief's temp dir for ``dirpath`` (given either path); safe to repeat.

    What a save staged beside it (``workertemp_<id>.<anything>``) goes with it.
    Does nothing on the chief or in a single process.

    >>> remove_temp_dirpath("/tmp/ckpt", "chief", 0, {"chief": ["c:1"]})
    """
    if should_checkpoint(cluster_spec, task_type, task_id):
        return
    _remove_temp_dir(_temp_dir(dirpath, task_id))


def _remove_temp_dir(temp_dir):
    """Removes a temp dir and what was written beside it under its name (a staged copy)."""
    shutil.rmtree(temp_dir, ignore_errors=True)
    parent, name = os.path.split(temp_dir)
    for sibling in _entries(parent):
        if sibling.startswith(name + "."):
            path = os.path.join(parent, sibling)
            if os.path.isdir(path):
                shutil.rmtree(path, ignore_errors=True)
            else:
                with contextlib.suppress(OSError):
                    os.remove(path)


def _entries(directory) -> list:
    try:
        return os.listdir(directory or ".")
    except OSError:
        return []


def remove_orphaned_temp_dirs(dirpath, task_type=None, task_id=None, cluster_spec=None):
    """On the chief: removes the temp dirs in ``dirpath`` that no task of this job writes.

    A worker killed while it saved leaves its ``workertemp_<id>``; the same task's
    next process removes it (``remove_temp_dirpath``), but a job that restarts
    without that task never would. The temp dirs of this job's non-chief tasks
    are theirs and left alone. Does nothing on a non-chief.

    >>> import tempfile
    >>> root = tempfile.mkdtemp()
    >>> _ = [os.makedirs(os.path.join(root, f"workertemp_{i}")) for i in (1, 2)]
    >>> remove_orphaned_temp_dirs(root, "worker", 0, {"worker": ["w0:1", "w1:1"]})
    >>> sorted(os.listdir(root))
    ['workertemp_1']
    """
    if not should_checkpoint(cluster_spec, task_type, task_id):
        return
    spec = _normalize(cluster_spec)
    live = {
        _temp_dirname(index)
        for job in spec.jobs
        for index in spec.task_indices(job)
        if not should_checkpoint(spec, job, index)
    }
    for name in _entries(dirpath):
        if _TEMP_DIR.fullmatch(name) and name not in live:
            _remove_temp_dir(os.path.join(dirpath, name))


def remove_temp_dir_with_filepath(filepath, task_type=None, task_id=None, cluster_spec=None):
    """``remove_temp_dirpath`` for the directory of ``filepath``.

    >>> remove_temp_dir_with_filepath("/tmp/ckpt/model.keras", "chief", 0, {"chief": ["c:1"]})
    """
    remove_temp_dirpath(os.path.dirname(filepath), task_type, task_id, cluster_spec)
