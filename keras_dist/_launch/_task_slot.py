"""One task of a ``MultiProcessRunner``: its record across restarts, and its status."""

from typing import NamedTuple

from keras_dist._launch import _process


class TaskStatus(NamedTuple):
    """One task's state, from ``MultiProcessRunner.process_status()``.

    ``state`` is ``"not started"``, ``"running"``, ``"succeeded"``, ``"failed"``,
    ``"lost"`` (failed, and the job goes on without it: the runner's ``survivable``
    tasks) or ``"terminated"`` (stopped by the runner or by you); ``exit_code`` is negative
    when a signal ended the process; ``restarts`` counts automatic and manual restarts.

    >>> status = TaskStatus("failed", exit_code=-9, pid=1234, restarts=0)
    >>> status.state, status.exit_code
    ('failed', -9)
    """

    state: str
    exit_code: int | None
    pid: int | None
    restarts: int


class TaskSlot:
    """The runner's record of one task, across its restarts."""

    def __init__(self, process: _process.TaskProcess):
        self.process = process
        self.starts = 0
        self.exit_code = None
        self.outcome = None
        # Stopped by the runner or the user: neither a failure nor restarted.
        self.stopped = False
        self.failed_at = None
        self.survived = False  # failed, and the job goes on without it

    @property
    def started(self) -> bool:
        return self.starts > 0

    @property
    def returned(self) -> bool:
        return self.outcome is not None and self.outcome.returned

    @property
    def state(self) -> str:
        if not self.started:
            return "not started"
        if self.exit_code is None:
            return "running"
        if self.failed_at is not None:
            return "lost" if self.survived else "failed"
        if self.stopped and not self.returned:
            return "terminated"
        return "succeeded"
