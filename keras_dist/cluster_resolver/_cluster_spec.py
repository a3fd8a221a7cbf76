"""``ClusterSpec``: the jobs of a cluster and the addresses of their tasks.

Follows ``tf.train.ClusterSpec``: a job is a list of addresses (task ``i`` at
position ``i``) or a sparse dict ``{index: address}``. ``{0: h}`` and ``[h]``
describe the same job, so they compare equal. A ``tf.train.ClusterSpec`` is taken
wherever a cluster is (TF's tutorials build one): it is recognised by its
methods, without importing TensorFlow, and read through its ``as_dict()``.
"""


def is_foreign_cluster_spec(cluster) -> bool:
    """Whether ``cluster`` is another library's cluster spec (``tf.train.ClusterSpec``).

    Recognised by what TF's class offers (``as_dict``, ``as_cluster_def``, ``jobs``),
    so that keras_dist never imports TensorFlow to check.
    """
    if isinstance(cluster, (dict, ClusterSpec)):
        return False
    kind = type(cluster)
    return (
        callable(getattr(kind, "as_dict", None))
        and callable(getattr(kind, "as_cluster_def", None))
        and hasattr(kind, "jobs")
    )


def is_cluster(cluster) -> bool:
    """Whether ``ClusterSpec(cluster)`` takes ``cluster``'s type: a dict, a ``ClusterSpec``
    of keras_dist's or a ``tf.train.ClusterSpec``."""
    return isinstance(cluster, (dict, ClusterSpec)) or is_foreign_cluster_spec(cluster)


class ClusterSpec:
    """Jobs of a cluster, each a list or a sparse dict ``{task_index: address}``.

    >>> spec = ClusterSpec({"worker": ["w0:2222", "w1:2222"], "ps": {0: "p0:2222", 3: "p3:2222"}})
    >>> spec.jobs
    ['worker', 'ps']
    >>> spec.num_tasks("ps"), spec.task_indices("ps")
    (2, [0, 3])
    >>> spec.job_tasks("ps")
    ['p0:2222', None, None, 'p3:2222']
    >>> spec.task_address("worker", 1)
    'w1:2222'
    >>> ClusterSpec({"job": {0: "h:1"}}) == ClusterSpec({"job": ["h:1"]})
    True
    >>> bool(ClusterSpec({}))
    False

    A ``tf.train.ClusterSpec`` (or a spec of this class) gives the same jobs:
    ``ClusterSpec(tf.train.ClusterSpec({"worker": ["w0:2222"]}))``.
    """

    def __init__(self, cluster):
        if isinstance(cluster, ClusterSpec) or is_foreign_cluster_spec(cluster):
            cluster = cluster.as_dict()
        if not isinstance(cluster, dict):
            raise TypeError(
                "`cluster` must be a dict mapping job names to lists of addresses or to "
                "dicts {task_index: address}, a `ClusterSpec` or a `tf.train.ClusterSpec`. "
                f"Received: cluster={cluster!r} of type {type(cluster).__name__}"
            )
        self._cluster = {}
        for job, tasks in cluster.items():
            if isinstance(tasks, (list, tuple)):
                self._cluster[job] = dict(enumerate(tasks))
            elif isinstance(tasks, dict):
                # JSON (TF_CONFIG) keys are strings; TF turns them into ints.
                self._cluster[job] = {int(i): address for i, address in tasks.items()}
            else:
                raise TypeError(
                    f"The tasks for job {job!r} must be a list or a dict from integers to "
                    f"strings. Received: tasks={tasks!r}"
                )

    def __bool__(self):
        return bool(self._cluster)

    def __eq__(self, other):
        if isinstance(other, dict) or is_foreign_cluster_spec(other):
            other = ClusterSpec(other)
        if not isinstance(other, ClusterSpec):
            return NotImplemented
        return self.as_dict() == other.as_dict()

    __hash__ = None

    def __repr__(self):
        items = ", ".join(f"{job!r}: {tasks!r}" for job, tasks in sorted(self.as_dict().items()))
        return f"ClusterSpec({{{items}}})"

    @property
    def jobs(self):
        """The job names, in the order they were given."""
        return list(self._cluster)

    def _job(self, job_name):
        try:
            return self._cluster[job_name]
        except KeyError:
            raise ValueError(
                f"No such job in cluster: {job_name!r}. Received: job_name={job_name!r}, "
                f"jobs={self.jobs!r}"
            ) from None

    def num_tasks(self, job_name):
        """The number of tasks in ``job_name``; raises ``ValueError`` for an unknown job."""
        return len(self._job(job_name))

    def task_indices(self, job_name):
        """The sorted task indices of ``job_name``."""
        return sorted(self._job(job_name))

    def task_address(self, job_name, task_index):
        """The address of task ``task_index`` of ``job_name``; ``ValueError`` if unknown."""
        job = self._job(job_name)
        try:
            return job[task_index]
        except KeyError:
            raise ValueError(
                f"No task with index {task_index!r} in job {job_name!r}. "
                f"Received: task_index={task_index!r}"
            ) from None

    def job_tasks(self, job_name):
        """The addresses of ``job_name`` by index, ``None`` where a sparse job has a hole."""
        job = self._job(job_name)
        tasks = [None] * (max(job) + 1 if job else 0)
        for index, address in job.items():
            tasks[index] = address
        return tasks

    def as_dict(self):
        """A dict of job to list of addresses (dense jobs) or ``{index: address}`` (sparse)."""
        result = {}
        for job, tasks in self._cluster.items():
            if tasks and max(tasks) + 1 != len(tasks):
                result[job] = {i: tasks[i] for i in sorted(tasks)}
            else:
                result[job] = self.job_tasks(job)
        return result
