"""The ``keras-dist`` command.

``keras-dist launch`` runs a script once per task of a local cluster (127.0.0.1, free ports),
each process with its ``TF_CONFIG``, and streams their output prefixed with the task::

    keras-dist launch --workers 2 train.py --epochs 3
    python -m keras_dist._launch._cli launch --chief --workers 2 train.py

It exits with 0 when every task succeeded, otherwise with the exit code of the first task
that failed (128 + N for a task killed by signal N, 124 after ``--timeout``). Ctrl-C, SIGTERM
or SIGHUP (a closed terminal) stops the tasks: SIGTERM, then SIGKILL after a grace period,
and the command exits with 128 + the signal's number. If the command itself is killed
(SIGKILL), its tasks die with it (see ``_bootstrap``).
"""

import argparse
import os
import signal
import sys

from keras_dist._launch._errors import SubprocessTimeoutError
from keras_dist._launch._errors import UnexpectedSubprocessExitError
from keras_dist._launch._errors import WorkerError
from keras_dist._launch._hosts import check_hosts
from keras_dist._launch._launcher import kept_per_task
from keras_dist._launch._launcher import run_elastic
from keras_dist._launch._process import describe_exit
from keras_dist._launch._program import ScriptProgram
from keras_dist._launch._runner import MultiProcessRunner
from keras_dist.parameter_server._job import ps_environment

_TIMEOUT_EXIT_CODE = 124  # As the `timeout` command.
# Signals that stop every task in order (SIGHUP: the terminal closed), where they exist.
_STOP_SIGNALS = tuple(
    getattr(signal, name) for name in ("SIGINT", "SIGTERM", "SIGHUP") if hasattr(signal, name)
)

_EXAMPLES = """\
examples:
  keras-dist launch --workers 2 train.py --epochs 3
  keras-dist launch --chief --workers 2 --devices-per-worker 2 train.py
  keras-dist launch --workers 2 --devices-per-worker 2,4 train.py
  keras-dist launch --chief --ps 1 --workers 2 examples/parameter_server_fit.py
  keras-dist launch --workers 4 --max-restarts 3 -m my_package.train
  keras-dist launch --workers 2:4 --max-restarts 3 train.py
  keras-dist launch --workers 3 --hosts n1,n2,n3 --host-command 'ssh {host}' train.py
"""


def main(argv: list[str] | None = None) -> int:
    """Runs ``keras-dist`` with ``argv`` (default: the command line); returns the exit code."""
    parser = _parser()
    options = parser.parse_args(argv)
    if options.command is None:
        parser.print_help()
        return 2
    if not options.module and not os.path.isfile(options.script):
        _launch_error(f"no such script: {options.script!r}")
    try:
        return _launch(options)
    except (ValueError, OSError) as error:
        # Options that do not fit together (a count per task for other tasks, a log
        # directory that cannot be made): said as argparse says the others.
        _launch_error(str(error))


def _launch_error(message: str):
    """Exits as argparse does for ``keras-dist launch``'s own options (code 2)."""
    sys.stderr.write(
        f"keras-dist launch: error: {message}\n(`keras-dist launch --help` lists the options)\n"
    )
    raise SystemExit(2)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="keras-dist", description="Tools for keras_dist, the tf.distribute API for Keras 3."
    )
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    launch = commands.add_parser(
        "launch",
        help="run a script once per task of a local cluster",
        description=(
            "Run `python SCRIPT ARGS` once per task of a cluster on 127.0.0.1, each process "
            "with its TF_CONFIG, so that MultiWorkerMirroredStrategy() in the script finds "
            "the others. Output is streamed, prefixed with the task."
        ),
        epilog=_EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    launch.add_argument(
        "--workers",
        type=_worker_range,
        default=(2, 2),
        metavar="N",
        help=(
            "worker tasks (default: 2); MIN:MAX starts MAX and, with --max-restarts, "
            "goes on with fewer (not under MIN) when a worker is killed by a signal or "
            "fails twice in a row"
        ),
    )
    launch.add_argument("--chief", action="store_true", help="add a chief task")
    launch.add_argument(
        "--ps",
        type=_count(0),
        default=0,
        metavar="N",
        help="parameter-server tasks (default: 0); the job ends with the chief, else the workers",
    )
    launch.add_argument(
        "--devices-per-worker",
        type=_counts(1),
        default=None,
        metavar="K",
        help=(
            "simulated CPU devices per task, or one count per task, comma separated "
            "(chief, workers, then ps: 2,4); default: one device each"
        ),
    )
    launch.add_argument(
        "--max-restarts",
        type=_count(0),
        default=0,
        metavar="R",
        help="restart every task on new ports up to R times after a failure (default: 0)",
    )
    launch.add_argument(
        "--timeout",
        type=_seconds(positive=True),
        default=None,
        metavar="S",
        help="stop every task after S seconds, restarts included, and exit with 124",
    )
    launch.add_argument(
        "--grace",
        type=_seconds(positive=False),
        default=30.0,
        metavar="S",
        help="after a task failed, seconds the others get before they are stopped (default: 30)",
    )
    launch.add_argument(
        "--hosts",
        type=lambda text: [part for part in text.split(",") if part],
        default=None,
        metavar="H,...",
        help=(
            "one host address per task (chief, workers, then ps), to run each task there "
            "with --host-command instead of on 127.0.0.1; the hosts share this file system"
        ),
    )
    launch.add_argument(
        "--host-command",
        default=None,
        metavar="CMD",
        help="how a task reaches its host, {host} standing for the address: 'ssh {host}'",
    )
    launch.add_argument(
        "--log-dir", default=None, metavar="DIR", help="keep each task's log in DIR/<task>.log"
    )
    launch.add_argument(
        "-m", "--module", action="store_true", help="run SCRIPT as a module (python -m SCRIPT)"
    )
    launch.add_argument("script", metavar="SCRIPT", help="the Python script (or module)")
    launch.add_argument(
        "script_args", nargs=argparse.REMAINDER, metavar="ARGS", help="the script's arguments"
    )
    return parser


def _launch(options: argparse.Namespace) -> int:
    program = ScriptProgram(options.script, options.script_args, module=options.module)

    min_workers, num_workers = options.workers

    def runner(cluster, kept_workers):
        return MultiProcessRunner(
            program,
            cluster,
            env=ps_environment(None) if options.ps else None,
            devices_per_worker=kept_per_task(
                options.devices_per_worker, options.chief, num_workers, kept_workers
            ),
            # A parameter-server job goes on without a failed worker, as TF's does.
            survivable=("worker",) if options.ps else (),
            failure_grace=options.grace,
            log_dir=options.log_dir,
            host_command=options.host_command,
        )

    # A signal ignored on purpose (`nohup`, a background job's SIGINT) stays ignored.
    previous = {
        sig: signal.signal(sig, _stop)
        for sig in _STOP_SIGNALS
        if signal.getsignal(sig) is not signal.SIG_IGN
    }
    try:
        run_elastic(
            runner,
            num_workers=num_workers,
            min_workers=min_workers,
            has_chief=options.chief,
            num_ps=options.ps,
            max_restarts=options.max_restarts,
            timeout=options.timeout,
            hosts=check_hosts(
                options.hosts, options.host_command, int(options.chief) + num_workers + options.ps
            ),
            host_command=options.host_command,
        )
    except SubprocessTimeoutError:
        _say(f"the tasks did not finish within --timeout {options.timeout:g} s; stopped them.")
        return _TIMEOUT_EXIT_CODE
    except (UnexpectedSubprocessExitError, WorkerError) as error:
        code = error.exit_codes.get((error.task_type, error.task_id))
        _say(f"{error.task_type} {error.task_id} failed ({describe_exit(code)}).")
        return _shell_exit_code(code)
    except _Stopped as stop:
        _say(f"stopped by {signal.Signals(stop.signum).name}; every task was stopped.")
        return 128 + stop.signum
    finally:
        for sig, handler in previous.items():
            # None: a handler installed outside Python, which cannot be put back.
            signal.signal(sig, signal.SIG_DFL if handler is None else handler)
    return 0


class _Stopped(BaseException):
    """Ctrl-C, SIGTERM or SIGHUP reached the launcher (a BaseException, as KeyboardInterrupt)."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


def _stop(signum, frame) -> None:
    del frame
    # os.write: the main thread may be inside sys.stdout/sys.stderr when the signal comes.
    try:
        os.write(2, f"keras-dist: {signal.Signals(signum).name}: stopping every task.\n".encode())
    except OSError:
        pass  # No terminal any more (SIGHUP): stop the tasks all the same.
    # Raised in the main thread, wherever it waits: leaving the runner's `with` block stops
    # the tasks (SIGTERM, then SIGKILL). A second signal there kills them at exit instead.
    raise _Stopped(signum)


def _shell_exit_code(code: int | None) -> int:
    if code is None or code == 0:
        return 1
    return 128 - code if code < 0 else code


def _say(message: str) -> None:
    try:
        print(f"keras-dist: {message}", file=sys.stderr, flush=True)
    except (OSError, ValueError):
        pass  # stderr is gone (the terminal closed).


def _count(minimum: int):
    def integer(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be a whole number, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be at least {minimum}, got {value}")
        return value

    return integer


def _worker_range(text: str) -> "tuple[int, int]":
    """``N`` (a fixed size) or ``MIN:MAX`` (an elastic job): ``(min, max)``."""
    low, _, high = text.partition(":")
    one = _count(1)
    minimum, maximum = one(low), one(high or low)
    if minimum > maximum:
        raise argparse.ArgumentTypeError(f"MIN must not exceed MAX, got {text}")
    return minimum, maximum


def _counts(minimum: int):
    """One count (``2``) or one per task (``2,4``)."""
    one = _count(minimum)

    def counts(text: str) -> "int | list[int]":
        values = [one(part) for part in text.split(",")]
        return values[0] if len(values) == 1 else values

    return counts


def _seconds(positive: bool):
    def seconds(text: str) -> float:
        value = float(text)
        if value < 0 or (positive and value == 0):
            bound = "> 0" if positive else ">= 0"
            raise argparse.ArgumentTypeError(f"must be seconds {bound}, got {value:g}")
        return value

    return seconds


if __name__ == "__main__":
    sys.exit(main())
