"""Keras's own tests, plain and under each strategy, as one table.

    python tests/keras_suite/run.py                      # every folder, every strategy
    python tests/keras_suite/run.py --folders trainers callbacks --strategies mirrored
    python tests/keras_suite/run.py --folders trainers \
        --strategies multi_worker_mirrored parameter_server       # about 22 + 3 minutes

Each strategy runs in its own pytest process (4 simulated CPU devices) over Keras's test
files for the installed Keras version (``keras_sources.py`` fetches them);
``multi_worker_mirrored`` runs one pytest in 2 worker processes at once (2 devices each,
``multi_worker.py``), ``parameter_server`` over an in-process cluster of 2 workers and 2 ps
tasks (``KERAS_DIST_SUITE_PS_WORKERS=1`` for one worker). A test counts
against a strategy when it passes plain and fails under the strategy; such a test is
either on the reviewed list (``known_differences.py``, each entry with its reason) or it
is a bug. With ``--strategies`` not naming ``plain``, only the tests that fail under a
strategy are run plain, to tell a bug from a test that fails anyway.

Exit status 1 when a test counts against a strategy and is not on the reviewed list, or
when a reviewed entry no longer fails (the list stays short and true).
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import re
import signal
import subprocess
import sys
import tempfile

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from keras_sources import SUITE_FOLDERS  # noqa: E402
from keras_sources import keras_version  # noqa: E402
from keras_sources import test_sources  # noqa: E402
from known_differences import KNOWN_DIFFERENCES  # noqa: E402
from multi_worker import run_on_workers  # noqa: E402
from strategy_plugin import STRATEGIES  # noqa: E402

PER_PROCESS_TIMEOUT_S = 3600


def run_pytest(
    strategy: str, sources: pathlib.Path, targets: list[str], jobs: int = 1
) -> dict[str, str]:
    """Outcome by test id (relative to ``sources``) of one pytest run (``jobs`` workers)."""
    with tempfile.TemporaryDirectory() as scratch:
        report = pathlib.Path(scratch) / "outcomes.json"
        env = dict(os.environ)
        env.update(
            KERAS_DIST_SUITE_STRATEGY=strategy,
            KERAS_DIST_SUITE_REPORT=str(report),
            PYTHONPATH=os.pathsep.join([str(HERE), str(sources), env.get("PYTHONPATH", "")]),
        )
        # The plugin asks for its simulated devices; a count inherited from a caller (our
        # own conftest sets 8) would win or clash.
        env["XLA_FLAGS"] = re.sub(
            r"--xla_force_host_platform_device_count=\d+", "", env.get("XLA_FLAGS", "")
        ).strip()
        env.setdefault("JAX_PLATFORMS", "cpu")
        command = [
            sys.executable,
            "-m",
            "pytest",
            "-p",
            "strategy_plugin",
            "-p",
            "no:cacheprovider",
            "--import-mode=importlib",
            "-q",
            "--no-header",
            "-o",
            "console_output_style=classic",
            "--timeout=600",
            "--continue-on-collection-errors",
        ]
        print(f"[{strategy}] {len(targets)} target(s)", flush=True)
        if strategy == "multi_worker_mirrored":
            # Both workers run the same tests in the same order; a test stuck outside
            # Python (a collective) ends its process rather than the run.
            command += ["-p", "no:randomly", "--timeout-method=thread", *targets]
            return run_on_workers(command, env, sources, PER_PROCESS_TIMEOUT_S)
        # pytest-xdist's workers each load the plugin (and so the strategy) themselves.
        command += [*(["-n", str(jobs)] if jobs > 1 else []), *targets]
        completed = subprocess.run(
            command,
            cwd=sources,
            env=env,
            timeout=PER_PROCESS_TIMEOUT_S,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        if not report.exists():
            raise RuntimeError(
                f"pytest under {strategy!r} wrote no report (exit {completed.returncode}):\n"
                + completed.stdout[-5000:]
            )
        log = sources / f"last_{strategy}.log"
        log.write_text(completed.stdout)
        print(f"[{strategy}] pytest's output: {log}", flush=True)
        return json.loads(report.read_text())


def default_jobs() -> int:
    """One pytest worker per CPU, at most 4 (each simulates 4 devices of its own)."""
    try:
        import xdist  # noqa: F401
    except ImportError:
        return 1
    return max(1, min(4, len(os.sched_getaffinity(0))))


def compare(
    plain: dict[str, str], under: dict[str, str], strategy: str
) -> tuple[list[str], list[str], list[str]]:
    """(reviewed differences, unexplained failures, stale reviewed entries) for one strategy."""
    regressions = sorted(
        test
        for test, outcome in under.items()
        if outcome == "failed" and plain.get(test) == "passed"
    )
    reviewed = [t for t in regressions if strategy in KNOWN_DIFFERENCES.get(t, ((), ""))[0]]
    unexplained = [t for t in regressions if t not in reviewed]
    stale = sorted(
        test
        for test, (strategies, _) in KNOWN_DIFFERENCES.items()
        if strategy in strategies and under.get(test) == "passed"
    )
    return reviewed, unexplained, stale


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--folders", nargs="+", default=list(SUITE_FOLDERS), choices=SUITE_FOLDERS)
    parser.add_argument("--strategies", nargs="+", default=list(STRATEGIES), choices=STRATEGIES)
    parser.add_argument(
        "--jobs",
        type=int,
        default=default_jobs(),
        help="pytest-xdist workers per pytest run (default: one per CPU, at most 4)",
    )
    parser.add_argument("--json", type=pathlib.Path, help="write every outcome here")
    parser.add_argument(
        "--plain-from",
        type=pathlib.Path,
        help="take the plain outcomes from an earlier --json file instead of running them",
    )
    args = parser.parse_args(argv)
    # Killed with SIGTERM, the run still stops its pytest processes (``finally`` blocks).
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))

    sources = test_sources()
    strategies = [s for s in args.strategies if s != "plain"]
    outcomes = {s: run_pytest(s, sources, args.folders, args.jobs) for s in strategies}
    if args.plain_from:
        plain = json.loads(args.plain_from.read_text())["plain"]
    elif "plain" in args.strategies:
        plain = run_pytest("plain", sources, args.folders, args.jobs)
    else:
        failing = sorted({t for o in outcomes.values() for t, r in o.items() if r == "failed"})
        plain = run_pytest("plain", sources, failing, args.jobs) if failing else {}

    print(f"\nKeras {keras_version()}'s tests of {', '.join(args.folders)}")
    if "plain" in args.strategies:
        counts = {
            r: sum(1 for o in plain.values() if o == r) for r in ("passed", "failed", "skipped")
        }
        print(
            f"plain: {counts['passed']} passed, {counts['failed']} failed, "
            f"{counts['skipped']} skipped"
        )
    print(
        f"{'strategy':<12} {'passed':>7} {'fail (pass plain)':>18} {'reviewed':>9} "
        f"{'unexplained':>12}"
    )
    status = 0
    for strategy in strategies:
        reviewed, unexplained, stale = compare(plain, outcomes[strategy], strategy)
        passed = sum(1 for o in outcomes[strategy].values() if o == "passed")
        print(
            f"{strategy:<12} {passed:>7} {len(reviewed) + len(unexplained):>18} "
            f"{len(reviewed):>9} {len(unexplained):>12}"
        )
        for test in unexplained:
            print(f"  FAILS UNDER {strategy}: {test}")
        for test in stale:
            print(f"  REVIEWED ENTRY PASSES NOW under {strategy}, remove it: {test}")
        status |= bool(unexplained or stale)
    # A module that cannot be imported (an optional dependency such as TensorFlow or torch
    # is missing) fails plain too: its tests are not compared at all. Say which.
    unimportable = sorted(t for t, o in plain.items() if o == "failed" and "::" not in t)
    if unimportable:
        print(
            f"not compared: {len(unimportable)} test module(s) fail to import without a "
            "strategy too (see pytest's output for the missing module): " + ", ".join(unimportable)
        )
    if args.json:
        args.json.write_text(json.dumps({"plain": plain, **outcomes}, indent=1, sort_keys=True))
    return status


if __name__ == "__main__":
    sys.exit(main())
