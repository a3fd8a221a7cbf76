"""The program of one task's process: load the function, call it, write what happened.

Run as ``python _worker.py CALL_FILE RESULT_FILE`` (``python -m keras_dist._launch._worker``
works too). The runner starts it by path (through ``_bootstrap``, which then becomes this
program) so that a task imports ``keras_dist`` (and with it Keras and JAX) only when its
function needs them: a plain function starts in a fraction of a second. This module
therefore imports nothing from ``keras_dist``.

The call file is a pickled dict: ``sys_path`` (the parent's module search path),
``parent_pid``, and ``call``, the cloudpickled ``(fn, args, kwargs)``. The result file is a
pickled dict: ``{"ok": True, "value": <cloudpickled return value>}``, or ``{"ok": False,
"type_name", "message", "traceback", "exception": <cloudpickled exception or None>}``.
"""

import os
import pickle
import signal
import sys
import threading
import time
import traceback

import cloudpickle


def main(argv: list[str] | None = None) -> int:
    """Runs the call of ``argv = [call_file, result_file]``; returns the exit code."""
    call_path, result_path = sys.argv[1:] if argv is None else argv
    with open(call_path, "rb") as file:
        spec = pickle.load(file)
    # The parent's search path, as multiprocessing's "spawn" gives its children: modules the
    # parent imported by reference are found here. (Run by path, this file's folder came first.)
    sys.path[:] = spec["sys_path"]
    _die_with_parent(spec["parent_pid"])
    outcome = _call(spec["call"])
    temporary = result_path + ".tmp"
    with open(temporary, "wb") as file:
        pickle.dump(outcome, file)
    # Renamed into place so that the parent never reads half a file.
    os.replace(temporary, result_path)
    if not outcome["ok"]:
        _leave_cluster_now()
    return 0 if outcome["ok"] else 1


def _leave_cluster_now() -> None:
    """After fn failed in a multi-process JAX job: exit now, not through JAX's shutdown.

    JAX's shutdown would wait for peers that may be waiting for this process in
    a collective; exiting closes its connections, and they report it instead.
    """
    runtime = sys.modules.get("keras_dist._distributed_runtime")
    if runtime is not None and runtime.is_initialized():
        runtime.leave_now(1)


def _call(call: bytes) -> dict:
    try:
        fn, args, kwargs = cloudpickle.loads(call)
        value = fn(*args, **kwargs)
    except SystemExit:
        # sys.exit(code) in fn ends the task with that code, as in a script.
        raise
    except BaseException as error:  # KeyboardInterrupt in fn is reported too.
        print(_format(error), end="", file=sys.stderr)
        return _failure(error)
    try:
        return {"ok": True, "value": cloudpickle.dumps(value)}
    except Exception as error:
        print(_format(error), end="", file=sys.stderr)
        return _failure(
            TypeError(
                "The return value of fn could not be pickled; return plain Python or NumPy "
                f"values. Received: {type(value).__name__} ({error})"
            )
        )


def _failure(error: BaseException) -> dict:
    try:
        pickled = cloudpickle.dumps(error)
    except Exception:
        pickled = None
    return {
        "ok": False,
        "type_name": type(error).__qualname__,
        "message": str(error),
        "traceback": _format(error),
        "exception": pickled,
    }


def _format(error: BaseException) -> str:
    # Without the first frame, this module's `_call`: the traceback starts in the user's code.
    frames = error.__traceback__
    if frames is not None and frames.tb_frame.f_code is _call.__code__:
        frames = frames.tb_next
    return "".join(traceback.format_exception(type(error), error, frames))


def _die_with_parent(parent_pid: int) -> None:
    """Kills this task's process group when the launching process is gone.

    Tasks run in their own session (a Ctrl-C in the terminal reaches the launcher only), so
    a launcher killed with SIGKILL would otherwise leave them running. On Linux the kernel's
    parent-death signal, set by ``_bootstrap`` before this program started, kills the task
    first; this watch is the fallback elsewhere (and it also ends what the task started).
    """

    def watch():
        while os.getppid() == parent_pid:
            time.sleep(0.5)
        os.killpg(os.getpgrp(), signal.SIGKILL)

    threading.Thread(target=watch, name="keras-dist-parent-watch", daemon=True).start()


if __name__ == "__main__":
    sys.exit(main())
