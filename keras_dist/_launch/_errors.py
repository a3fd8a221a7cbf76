"""The errors of a multi-process run, each carrying every task's results, exit codes and logs.

Every message ends with the last lines of every task's log, labelled by task, so that a failed
test shows what each worker printed (a worker often fails because a peer failed first).
"""

import functools

# Lines of each task's log quoted in an error message.
LOG_TAIL_LINES = 60


def _attach(error, task_type=None, task_id=None, results=None, exit_codes=None, logs=None):
    error.task_type = task_type
    error.task_id = task_id
    error.results = list(results or [])
    error.exit_codes = dict(exit_codes or {})
    error.logs = dict(logs or {})
    return error


class SubprocessTimeoutError(RuntimeError):
    """The run took longer than ``max_run_time`` (or ``join``'s timeout); all tasks were stopped.

    Attributes: ``results`` (per task, ``None`` where it did not return), ``exit_codes`` and
    ``logs`` (dicts keyed by ``(task_type, task_id)``).

    >>> error = SubprocessTimeoutError("Timed out", exit_codes={("worker", 0): -9})
    >>> error.exit_codes
    {('worker', 0): -9}
    """

    def __init__(self, message: str, **report):
        super().__init__(message)
        _attach(self, **report)


class UnexpectedSubprocessExitError(RuntimeError):
    """A task exited with a non-zero code, or was killed, other than by the runner.

    Attributes: ``task_type`` and ``task_id`` of the task, ``results``, ``exit_codes`` and
    ``logs`` of every task.

    >>> error = UnexpectedSubprocessExitError("worker 1 exited", task_type="worker", task_id=1)
    >>> error.task_type, error.task_id
    ('worker', 1)
    """

    def __init__(self, message: str, **report):
        super().__init__(message)
        _attach(self, **report)


class WorkerError(Exception):
    """A task's function raised; its exception could not be rebuilt here.

    When the exception can be rebuilt, the runner raises it with its own type instead, as an
    instance of a subclass of both that type and ``WorkerError``: ``except ValueError`` and
    ``except WorkerError`` both catch it, and its message is this report.

    Attributes: ``task_type``, ``task_id``, ``exception_type`` (the name of the exception's
    class), ``remote_traceback``, and ``results``, ``exit_codes``, ``logs`` of every task.

    >>> error = WorkerError("worker 0 raised KeyError: 'x'", task_type="worker", task_id=0)
    >>> isinstance(error, Exception), error.task_id
    (True, 0)
    """

    def __init__(self, message: str, **report):
        super().__init__(message)
        _attach(self, **report)


def remote_error(failure, message: str, **report) -> BaseException:
    """The error to raise for a task's ``RemoteFailure``: its own type when possible.

    >>> from keras_dist._launch._program import RemoteFailure
    >>> error = remote_error(RemoteFailure("ValueError", "bad", "", ValueError("bad")), "report")
    >>> isinstance(error, ValueError), isinstance(error, WorkerError), str(error)
    (True, True, 'report')
    """
    error = None
    if failure.exception is not None:
        error = _rebuild(failure.exception, message)
    if error is None:
        error = WorkerError(message)
    _attach(error, **report)
    error.exception_type = failure.type_name
    error.remote_traceback = failure.traceback
    return error


def _rebuild(exception: BaseException, message: str) -> BaseException | None:
    try:
        cls = _remote_class(type(exception))
        error = cls.__new__(cls, *exception.args)
        reduced = exception.__reduce__()  # (type, args[, state]): pickle's copy of its state
        if len(reduced) > 2 and reduced[2]:
            error.__setstate__(reduced[2])
    except Exception:
        return None  # A type that cannot be subclassed, or whose state cannot be copied.
    error.report_message = message
    return error


@functools.cache
def _remote_class(cls: type) -> type:
    # The original type first: `except cls` and isinstance checks work, and the traceback
    # shows the original name. str() is the report, not the bare original message.
    return type(
        cls.__name__,
        (cls, WorkerError),
        {
            "__module__": cls.__module__,
            "__qualname__": cls.__qualname__,
            "__str__": lambda self: self.report_message,
        },
    )


def format_logs(tasks, lines: int = LOG_TAIL_LINES) -> str:
    """The last ``lines`` of each task's log, labelled: ``tasks`` holds ``(name, status, text)``.

    >>> print(format_logs([("worker 0", "exit code 1", "a\\nb\\n")], lines=1))
    Logs of every task (last 1 lines each):
    ===== worker 0 (exit code 1) =====
    b
    """
    parts = [f"Logs of every task (last {lines} lines each):"]
    for name, status, text in tasks:
        parts.append(f"===== {name} ({status}) =====")
        parts.extend(text.splitlines()[-lines:] or ["(no output)"])
    return "\n".join(parts)
