"""Keras's tests under MultiWorkerMirroredStrategy: one pytest in 2 worker processes at once.

Both workers run the same tests in the same order (no pytest-xdist, no random order), each
inside a ``MultiWorkerMirroredStrategy`` over the local cluster in its ``TF_CONFIG``
(127.0.0.1, free ports; worker 0 is the chief). ``strategy_plugin.py`` makes them start
each test together and appends every outcome to a progress file as it comes. A test passes
when it passes on both workers; one that fails on either fails.

A hang is a failure, never a stuck run: a collective the other worker never joins fails
after the plugin's ``COLLECTIVE_TIMEOUT_S``, a test that runs past pytest-timeout's limit
ends its process, and a worker left alone is stopped. When a worker is lost, the test it
was in fails and both workers start again after it (at most ``MAX_RESTARTS`` times).
Processes that started JAX's distributed runtime may ignore SIGTERM: every worker's process
group gets SIGKILL after a short grace period.
"""

from __future__ import annotations

import json
import os
import pathlib
import signal
import subprocess
import tempfile
import time

from strategy_plugin import TEST_START_TIMEOUT_S

NUM_WORKERS = 2
MAX_RESTARTS = 20
# A worker whose peer has ended waits at most this long (it may still finish its test).
_SURVIVOR_GRACE_S = TEST_START_TIMEOUT_S + 60
_TERMINATE_GRACE_S = 10
_POLL_S = 0.5


def run_on_workers(
    command: list[str], env: dict[str, str], cwd: pathlib.Path, timeout_s: float
) -> dict[str, str]:
    """Outcome by test id of ``command`` (a pytest run) on 2 workers: passed on both,
    skipped on both, or failed. Each worker's output goes to ``cwd/last_<strategy>_<i>.log``."""
    outcomes: dict[str, str] = {}
    logs = [cwd / f"last_multi_worker_mirrored_{i}.log" for i in range(NUM_WORKERS)]
    for log in logs:
        log.write_text("")
    for restart in range(MAX_RESTARTS + 1):
        started = time.monotonic()
        collected, by_worker = _one_round(command, env, cwd, logs, set(outcomes), timeout_s)
        if collected is None:
            raise RuntimeError(
                "The multi-worker pytest collected no tests (see its logs: "
                f"{', '.join(map(str, logs))}):\n" + logs[0].read_text()[-5000:]
            )
        lost = _merge(collected, by_worker, outcomes)
        print(
            f"[multi_worker_mirrored] round {restart + 1}: {len(outcomes)} of "
            f"{len(collected) + len(set(outcomes) - set(collected))} done in "
            f"{time.monotonic() - started:.0f} s",
            flush=True,
        )
        if lost is None:
            break
        print(
            f"[multi_worker_mirrored] a worker was lost (hang or crash) in {lost}"
            if lost
            else "[multi_worker_mirrored] the workers ended after a collective timed out",
            flush=True,
        )
    else:
        for test in collected:
            outcomes.setdefault(test, "failed")
    for i, log in enumerate(logs):
        print(f"[multi_worker_mirrored] worker {i}'s pytest output: {log}", flush=True)
    return outcomes


def _merge(collected, by_worker, outcomes) -> str | None:
    """Adds the tests both workers finished to ``outcomes``; returns the test a worker was
    lost in (it fails), or ``None`` once every collected test is done."""
    finished = [dict(r[1:] for r in records if r[0] == "test") for records in by_worker]
    started = {r[1] for records in by_worker for r in records if r[0] == "started"}
    for test in set().union(*finished) - set(collected):  # modules that failed to import
        outcomes[test] = "failed"
    progressed = False
    for test in collected:
        if test in outcomes:
            continue
        results = [records.get(test) for records in finished]
        if None in results:
            # A worker ended in this test, or both ended between tests (one saw the other
            # lost) and the next round goes on from here. A round that did nothing at all
            # also counts against its first test, so that every round moves on.
            if test in started or not progressed:
                outcomes[test] = "failed"
                return test
            return ""
        progressed = True
        if len(set(results)) > 1:
            print(
                f"[multi_worker_mirrored] the workers differ on {test}: "
                + ", ".join(f"worker {i} {r}" for i, r in enumerate(results)),
                flush=True,
            )
        outcomes[test] = results[0] if len(set(results)) == 1 else "failed"
    return None


def _one_round(command, env, cwd, logs, done, timeout_s):
    """Runs the workers once over the tests not in ``done``: (collected test ids, each
    worker's (test, outcome) records)."""
    from keras_dist import testing  # the runner itself needs no JAX until here

    cluster = testing.create_cluster_spec(num_workers=NUM_WORKERS)
    with tempfile.TemporaryDirectory() as scratch:
        scratch = pathlib.Path(scratch)
        (scratch / "done.json").write_text(json.dumps(sorted(done)))
        progress = [scratch / f"progress_{i}.jsonl" for i in range(NUM_WORKERS)]
        workers = []
        try:
            for i in range(NUM_WORKERS):
                task = {"cluster": cluster, "task": {"type": "worker", "index": i}}
                worker_env = dict(
                    env,
                    TF_CONFIG=json.dumps(task),
                    KERAS_DIST_SUITE_PROGRESS=str(progress[i]),
                    KERAS_DIST_SUITE_DONE=str(scratch / "done.json"),
                )
                with open(logs[i], "a") as log:
                    workers.append(
                        subprocess.Popen(
                            command,
                            cwd=cwd,
                            env=worker_env,
                            stdout=log,
                            stderr=subprocess.STDOUT,
                            start_new_session=True,  # its own group, children included
                        )
                    )
            _wait(workers, timeout_s)
        finally:
            _stop(workers)
        records = [_read(path) for path in progress]
    collected = next((r["collected"] for r in records[0] if "collected" in r), None)
    by_worker = [
        [
            ("test", r["test"], r["outcome"]) if "test" in r else ("started", r["started"])
            for r in rs
            if "collected" not in r
        ]
        for rs in records
    ]
    return collected, by_worker


def _wait(workers, timeout_s):
    """Until every worker ended, the round's time is up, or a worker alone ran too long."""
    deadline = time.monotonic() + timeout_s
    while any(w.poll() is None for w in workers) and time.monotonic() < deadline:
        if any(w.poll() is not None for w in workers):
            deadline = min(deadline, time.monotonic() + _SURVIVOR_GRACE_S)
        time.sleep(_POLL_S)


def _stop(workers):
    for signum in (signal.SIGTERM, signal.SIGKILL):
        for worker in workers:
            try:
                os.killpg(worker.pid, signum)
            except ProcessLookupError:
                pass  # the group is gone
        end = time.monotonic() + _TERMINATE_GRACE_S
        for worker in workers:
            try:
                worker.wait(max(0.0, end - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass  # SIGKILL next


def _read(path):
    if not path.exists():
        return []
    with open(path) as f:
        # The last line may be cut short by a killed process.
        return [json.loads(line) for line in f if line.endswith("\n")]
