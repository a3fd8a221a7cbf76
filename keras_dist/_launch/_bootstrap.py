"""The first code of every task's process: it ties the task's life to its launcher's.

Run by path (it imports only the standard library)::

    python _bootstrap.py LAUNCHER_PID MODE ARGS...
    python _bootstrap.py parent MODE --payload TEXT    # a task on a host of its own

(``parent``: the task lives as long as the process that started it on its host, such
as ``ssh``'s session; ``TEXT`` carries the task's environment and ``ARGS``, see ``pack``.)

``ARGS`` are the task's interpreter arguments (``script.py a b``, ``-m module a b``,
``_worker.py call result``). Tasks run in their own session, so signals that end the
launcher's process group never reach them, and a launcher killed outright (SIGKILL, a
closed terminal's SIGHUP) cannot stop them itself. So, before the task's program starts:

* ``exec`` (Linux): ask the kernel to send this process SIGKILL when the launcher dies
  (``prctl(PR_SET_PDEATHSIG)``), then become ``python ARGS`` (the setting survives
  ``exec``: the task keeps this pid and nothing of this module stays in it). The kernel's
  signal reaches the task alone, so a small reaper process forked first ends the task's
  process group (what the task itself started) once the task is gone.
* ``watch`` (elsewhere, or when ``prctl`` fails): a daemon thread checks twice a second that
  the launcher is still the parent and kills the task's process group when it is not; the
  task then runs in this interpreter, as ``python ARGS`` would run it (``runpy``).

In both modes a launcher that died before this ran (between its ``fork`` and here) is seen
at once: the parent is no longer ``LAUNCHER_PID``, and the task ends before it starts.
"""

import base64
import ctypes
import json
import os
import runpy
import signal
import sys
import threading
import time

_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
_WATCH_INTERVAL = 0.5
# Instead of a pid: the task lives as long as whatever started it on its host.
_PARENT = "parent"
# Then one argument: the task's environment and arguments (JSON in base64).
_PAYLOAD = "--payload"


def pack(env: dict, args: list) -> list:
    """``[--payload, TEXT]``: ``env`` and ``args`` in one word that no shell splits or expands.

    A task on another host is started through a remote shell (``ssh host ...``), which
    joins its words and parses them again, and which does not pass this environment.
    """
    payload = json.dumps({"env": env, "args": args}).encode()
    return [_PAYLOAD, base64.urlsafe_b64encode(payload).decode("ascii")]


def _unpack(text: str) -> list:
    payload = json.loads(base64.urlsafe_b64decode(text.encode("ascii")))
    os.environ.update(payload["env"])  # what ``execv`` hands the task
    return payload["args"]


def _launcher_pid(text: str) -> int:
    return os.getppid() if text == _PARENT else int(text)


def main(argv: list[str]) -> None:
    launcher_pid, mode, args = _launcher_pid(argv[0]), argv[1], argv[2:]
    if args[:1] == [_PAYLOAD]:
        args = _unpack(args[1])
    if not args:
        raise SystemExit(f"usage: _bootstrap.py LAUNCHER_PID|{_PARENT} exec|watch ARGS...")
    if mode == "exec":
        if set_parent_death_signal(signal.SIGKILL):
            _die_if_orphaned(launcher_pid)
            _fork_group_reaper()
            os.execv(sys.executable, [sys.executable, *args])
        # No parent-death signal here: watch instead, in an interpreter started the plain way
        # (this one may run without site-packages).
        os.execv(sys.executable, [sys.executable, __file__, str(launcher_pid), "watch", *args])
    watch_parent(launcher_pid)
    _run_here(args)


def set_parent_death_signal(signum: int) -> bool:
    """Asks Linux to send ``signum`` to this process when its parent dies; False elsewhere.

    The "parent" is the thread that started this process: the launcher starts tasks from a
    thread that lives as long as it does (``_process``).
    """
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(_PR_SET_PDEATHSIG, int(signum), 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def _fork_group_reaper() -> None:
    """Forks a process that SIGKILLs this task's process group once the task is gone.

    Only for a task that leads its own group (every launched task does): the group is then
    the task and what it started, never the launcher's.
    """
    task_pid = os.getpid()
    if os.getpgrp() != task_pid or os.fork() != 0:
        return
    try:
        # The reaper holds none of the task's files (the launcher reads the task's output
        # pipes until they close) and outlives the signals that ask the task to stop.
        devnull = os.open(os.devnull, os.O_RDWR)
        for fd in (0, 1, 2):
            os.dup2(devnull, fd)
        os.closerange(3, 1 << 16)
        for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            signal.signal(signum, signal.SIG_IGN)
        while os.getppid() == task_pid:
            time.sleep(_WATCH_INTERVAL)
        os.killpg(task_pid, signal.SIGKILL)
    finally:
        os._exit(0)


def watch_parent(launcher_pid: int) -> None:
    """Kills this process group (the task and what it started) once the launcher is gone."""
    _die_if_orphaned(launcher_pid)

    def watch():
        while os.getppid() == launcher_pid:
            time.sleep(_WATCH_INTERVAL)
        _kill_own_group()

    threading.Thread(target=watch, name="keras-dist-parent-watch", daemon=True).start()


def _die_if_orphaned(launcher_pid: int) -> None:
    if os.getppid() != launcher_pid:
        _kill_own_group()


def _kill_own_group() -> None:
    """SIGKILL to this task's process group (what it started too), or to itself alone."""
    if os.getpgrp() == os.getpid():  # A task leads its own session, so its own group.
        try:
            os.killpg(os.getpid(), signal.SIGKILL)
        except OSError:
            pass
    os.kill(os.getpid(), signal.SIGKILL)


def _run_here(args: list[str]) -> None:
    """Runs ``python ARGS`` in this interpreter (its ``sys.argv`` and ``sys.path[0]`` too)."""
    if args[0] == "-m":
        if len(args) < 2:
            raise SystemExit("Argument expected for the -m option")
        sys.argv = ["-m", *args[2:]]  # runpy puts the module's path first.
        sys.path[0] = os.getcwd()
        runpy.run_module(args[1], run_name="__main__", alter_sys=True)
    else:
        sys.argv = list(args)
        sys.path[0] = os.path.dirname(os.path.abspath(args[0]))
        runpy.run_path(args[0], run_name="__main__")


if __name__ == "__main__":
    main(sys.argv[1:])
