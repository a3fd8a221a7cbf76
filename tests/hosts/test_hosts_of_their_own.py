"""Clusters whose tasks run on hosts of their own: own addresses, links that fail.

Each task runs in a network namespace (``netns_hosts.NetnsHosts``) with its own address
on a private switch, instead of on 127.0.0.1 beside the others; a test can cut a host's
link (its packets dropped, no reset) and restore it. Every test ends in a named error
or a result within a stated bound, and prints every task's log when it fails.
"""

import contextlib
import json
import pathlib
import subprocess
import sys
import time

import host_tasks
import netns_hosts
import numpy as np
import pytest

pytestmark = [
    pytest.mark.multiprocess,
    pytest.mark.timeout(300),
    pytest.mark.skipif(
        netns_hosts.skip_reason() is not None, reason=str(netns_hosts.skip_reason())
    ),
]

TASKS = pathlib.Path(host_tasks.__file__)
PORT = 23456  # every host has its own addresses: one port number serves them all
STARTUP = 150  # seconds for a cluster's processes to import JAX and meet (2 loaded cores)


def _tf_config(cluster, task_type, index):
    return {
        "TF_CONFIG": json.dumps({"cluster": cluster, "task": {"type": task_type, "index": index}})
    }


@contextlib.contextmanager
def _logs_on_failure(hosts):
    try:
        yield
    except BaseException:
        print(hosts.logs())
        raise


def _read(out, name):
    return json.loads((out / f"{name}.json").read_text())


def test_hosts_have_their_own_addresses_and_links_that_fail():
    with netns_hosts.NetnsHosts(2) as hosts:
        made = hosts.namespaces()
        serve = f"import socket, time; s = socket.create_server(({hosts.addresses[1]!r}, {PORT}))"
        listener = hosts.start(1, [sys.executable, "-c", serve + "; time.sleep(600)"])
        with _logs_on_failure(hosts):
            deadline = time.monotonic() + 30
            while not hosts.can_reach(0, 1, PORT):
                assert time.monotonic() < deadline, "host 1 never answered"
            hostname = subprocess.run(
                ["ip", "netns", "exec", made[1], "cat", "/etc/hosts"],
                capture_output=True,
                text=True,
            ).stdout
            assert f"{hosts.addresses[0]} host0" in hostname
            hosts.cut(1)
            assert not hosts.can_reach(0, 1, PORT, timeout=1.0)  # dropped: no answer at all
            hosts.restore(1)
            assert hosts.can_reach(0, 1, PORT, timeout=10.0)
    assert listener.poll() is not None  # killed on the way out
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert not any(name in listed for name in made)


def test_fit_on_three_hosts_equals_one_device(tmp_path):
    cluster = {
        "worker": [f"{address}:{PORT}" for address in ["10.231.0.1", "10.231.0.2", "10.231.0.3"]]
    }
    with netns_hosts.NetnsHosts(3, log_dir=tmp_path) as hosts, _logs_on_failure(hosts):
        assert cluster["worker"][0].startswith(hosts.addresses[0])
        tasks = [
            hosts.python(i, TASKS, "mwms_fit", tmp_path, env=_tf_config(cluster, "worker", i))
            for i in range(3)
        ]
        assert netns_hosts.wait_all(tasks, STARTUP + 60) == [0, 0, 0]
        results = [np.load(tmp_path / f"worker{i}.npz") for i in range(3)]
        for result in results[1:]:
            np.testing.assert_array_equal(result["initial"], results[0]["initial"])
            np.testing.assert_array_equal(result["final"], results[0]["final"])
        assert _read(tmp_path, "worker2")["socket"] == ["host2", hosts.addresses[2]]
    # One device from the same first weights on the same global batches.
    import keras

    model = host_tasks.tiny_model()
    flat = results[0]["initial"]
    shapes = [w.shape for w in model.get_weights()]
    pieces = np.split(flat, np.cumsum([int(np.prod(s)) for s in shapes])[:-1])
    model.set_weights([w.reshape(s) for w, s in zip(pieces, shapes)])
    x, y = host_tasks.regression_data(host_tasks.FIT_ROWS)
    history = model.fit(
        x,
        y,
        batch_size=host_tasks.FIT_BATCH,
        epochs=host_tasks.FIT_EPOCHS,
        shuffle=False,
        verbose=0,
    )
    np.testing.assert_allclose(results[0]["final"], host_tasks.flat(model.get_weights()), atol=1e-5)
    np.testing.assert_allclose(
        _read(tmp_path, "worker0")["loss"], history.history["loss"], rtol=1e-5
    )
    assert keras.backend.backend() == "jax"


# ---------------------------------------------------------------- parameter servers
def _ps_cluster(hosts, out, started, after):
    """chief on host 0, worker on host 1, ps on host 2; the chief's process last.

    The chief runs ``started`` closures, then schedules one every 0.1 s until the
    test writes ``restored.mark``, then ``after`` more (``host_tasks.ps_chief``).
    """
    cluster = {
        "chief": [f"{hosts.addresses[0]}:{PORT}"],
        "worker": [f"{hosts.addresses[1]}:{PORT}"],
        "ps": [f"{hosts.addresses[2]}:{PORT}"],
    }
    token = {"KERAS_DIST_CLUSTER_TOKEN": "hosts-of-their-own-" + out.name}
    for host, task_type in ((2, "ps"), (1, "worker")):
        env = {**_tf_config(cluster, task_type, 0), **token}
        hosts.python(host, TASKS, "ps_server", out, env=env)
    env = {**_tf_config(cluster, "chief", 0), **token}
    return hosts.python(0, TASKS, "ps_chief", out, started, after, env=env)


PS_CUT_SECONDS = 5
# Seconds from the cut to the end of ``join``: the cut, gRPC dropping the silent
# connection (~5 s), reconnecting (< 2 s once the link is back) and the closures
# left (a few seconds on 2 loaded cores), with a margin.
PS_RECOVERY_BOUND = 45


def test_a_ps_link_cut_for_5_s_loses_no_closure_and_applies_each_once(tmp_path):
    with netns_hosts.NetnsHosts(3, log_dir=tmp_path) as hosts, _logs_on_failure(hosts):
        # Closures are scheduled all through the cut, and 40 more once the link is back.
        chief = _ps_cluster(hosts, tmp_path, started=5, after=40)
        netns_hosts.wait_for_file(tmp_path / "started.json", STARTUP, processes=[chief])
        hosts.cut(2)
        cut_at = time.time()
        time.sleep(PS_CUT_SECONDS)
        hosts.restore(2)
        (tmp_path / "restored.mark").touch()
        netns_hosts.wait_for_file(tmp_path / "counter.json", 120, processes=[chief])
        result = _read(tmp_path, "chief0")
        counted = _read(tmp_path, "counter")
        print(f"join ended {result['join_ended'] - cut_at:.1f} s after the cut: {result}")
        print(f"the counter: {counted}")
        assert result["error"] is None, result
        assert result["join_ended"] > cut_at + PS_CUT_SECONDS  # the cut fell mid-run
        assert result["join_ended"] - cut_at < PS_RECOVERY_BOUND
        assert result["scheduled"] > 5 + 40  # some were scheduled during the cut
        assert counted["counter"] == result["scheduled"]  # exactly once: none lost, none twice


# Seconds from the cut to the named error: gRPC dropping the silent connection (~5 s),
# the ps clients reconnecting for RECONNECT_SECONDS (30 s), and a margin.
PS_LOST_BOUND = 75


def test_a_ps_link_cut_for_good_makes_join_raise_a_named_error_in_time(tmp_path):
    with netns_hosts.NetnsHosts(3, log_dir=tmp_path) as hosts, _logs_on_failure(hosts):
        chief = _ps_cluster(hosts, tmp_path, started=5, after=0)  # paced until the error
        netns_hosts.wait_for_file(tmp_path / "started.json", STARTUP, processes=[chief])
        hosts.cut(2)
        cut_at = time.time()
        netns_hosts.wait_for_file(tmp_path / "chief0.json", PS_LOST_BOUND, processes=[chief])
        result = _read(tmp_path, "chief0")
        print(f"join ended {result['join_ended'] - cut_at:.1f} s after the cut: {result}")
        assert result["error"] in ("UnavailableError", "DeadlineExceededError"), result
        assert "/job:ps/replica:0/task:0" in result["message"]
        assert result["join_ended"] - cut_at < PS_LOST_BOUND


# ---------------------------------------------------------- MWMS: a worker's link lost
COLLECTIVE_TIMEOUT = 10  # CommunicationOptions.timeout_seconds
LOST_MARGIN = 30  # seconds past it for the survivors to name the lost task and end


def test_a_worker_link_cut_for_good_mid_fit_makes_the_survivors_name_it(tmp_path):
    cluster = {"worker": [f"{netns_hosts.SUBNET}.{i + 1}:{PORT}" for i in range(3)]}
    with netns_hosts.NetnsHosts(3, log_dir=tmp_path) as hosts, _logs_on_failure(hosts):
        tasks = [
            hosts.python(
                i,
                TASKS,
                "mwms_lose_link",
                tmp_path,
                COLLECTIVE_TIMEOUT,
                env=_tf_config(cluster, "worker", i),
            )  # fmt: skip
            for i in range(3)
        ]
        netns_hosts.wait_for_file(tmp_path / "worker2-batch3.mark", STARTUP, processes=tasks)
        hosts.cut(2)
        cut_at = time.time()
        bound = COLLECTIVE_TIMEOUT + LOST_MARGIN
        for i in (0, 1):
            remaining = cut_at + bound - time.time()
            netns_hosts.wait_for_file(tmp_path / f"worker{i}.json", max(remaining, 0.1))
        survivors = [_read(tmp_path, f"worker{i}") for i in (0, 1)]
        for i, survivor in enumerate(survivors):
            print(f"worker {i}, {survivor['time'] - cut_at:.1f} s after the cut: {survivor}")
        for survivor in survivors:
            assert survivor["error"] in ("UnavailableError", "DeadlineExceededError"), survivor
            assert "worker 2" in survivor["message"], survivor
            assert survivor["time"] - cut_at < bound
        # ...and they exit (the exit hook), not left waiting on the lost peer.
        assert netns_hosts.wait_all(tasks[:2], 30) == [1, 1]


def _mwms_tasks(hosts, out, role, *args):
    """One task of a 3-worker MWMS cluster on each host (worker ``i`` on host ``i``)."""
    cluster = {"worker": [f"{address}:{PORT}" for address in hosts.addresses]}
    return [
        hosts.python(i, TASKS, role, out, *args, env=_tf_config(cluster, "worker", i))
        for i in range(len(hosts.addresses))
    ]


def _wait_exits(processes, timeout):
    """Each process's exit status and time (``None`` for those still running after ``timeout``)."""
    deadline = time.time() + timeout
    ended = [None] * len(processes)
    while time.time() < deadline and None in ended:
        for i, process in enumerate(processes):
            if ended[i] is None and process.poll() is not None:
                ended[i] = time.time()
        time.sleep(0.1)
    return [process.poll() for process in processes], ended


CUT_SECONDS = 5
CUT_TIMEOUT = 20  # the collective timeout, longer than the cut
# Seconds from the restore to every task's end: TCP retransmitting (its backoff reaches
# a few seconds during the cut), the steps left (~10 s on 2 loaded cores) and JAX's
# shutdown, with a margin.
CUT_RECOVERY_BOUND = 60


def test_a_worker_link_cut_for_5_s_mid_fit_recovers_with_one_devices_weights(tmp_path):
    with netns_hosts.NetnsHosts(3, log_dir=tmp_path) as hosts, _logs_on_failure(hosts):
        tasks = _mwms_tasks(hosts, tmp_path, "mwms_fit_through_a_cut", CUT_TIMEOUT)
        netns_hosts.wait_for_file(tmp_path / "worker2-batch3.mark", STARTUP, processes=tasks)
        hosts.cut(2)
        cut_at = time.time()
        time.sleep(CUT_SECONDS)
        hosts.restore(2)
        restored_at = time.time()
        codes, ended = _wait_exits(tasks, CUT_RECOVERY_BOUND)
        for i, (code, end) in enumerate(zip(codes, ended)):
            after = "still running" if end is None else f"ended {end - restored_at:.1f} s"
            print(f"worker {i}: exit status {code}, {after} after the restore")
        results = [_read(tmp_path, f"worker{i}") for i in range(3)]
        for i, result in enumerate(results):
            gaps = np.diff(result["batch_ends"])
            print(f"worker {i}: {result.get('error')}, longest step {gaps.max():.1f} s")
            assert result["error"] is None, result
        assert codes == [0, 0, 0]
        # The cut fell mid-fit: the steps stopped through it, and went on after.
        stalled = np.diff(results[0]["batch_ends"]).max()
        assert stalled > CUT_SECONDS - 1
        assert results[0]["batch_ends"][-1] > restored_at
        weights = [np.load(tmp_path / f"worker{i}.npz") for i in range(3)]
        for result in weights[1:]:
            np.testing.assert_array_equal(result["final"], weights[0]["final"])
    # One device from the same first weights on the same global batches.
    model = host_tasks.tiny_model()
    shapes = [w.shape for w in model.get_weights()]
    pieces = np.split(weights[0]["initial"], np.cumsum([int(np.prod(s)) for s in shapes])[:-1])
    model.set_weights([w.reshape(s) for w, s in zip(pieces, shapes)])
    x, y = host_tasks.regression_data(host_tasks.CUT_FIT_ROWS)
    model.fit(x, y, batch_size=host_tasks.FIT_BATCH, epochs=1, shuffle=False, verbose=0)
    expected = host_tasks.flat(model.get_weights())
    np.testing.assert_allclose(weights[0]["final"], expected, atol=1e-5)
    print(f"cut for {restored_at - cut_at:.1f} s; longest step {stalled:.1f} s")


def test_the_coordinators_link_cut_for_good_mid_fit_makes_the_others_name_it(tmp_path):
    """Worker 0 hosts JAX's coordination service: its link cut, the others lose it too."""
    with netns_hosts.NetnsHosts(3, log_dir=tmp_path) as hosts, _logs_on_failure(hosts):
        tasks = _mwms_tasks(hosts, tmp_path, "mwms_lose_link", COLLECTIVE_TIMEOUT)
        netns_hosts.wait_for_file(tmp_path / "worker0-batch3.mark", STARTUP, processes=tasks)
        hosts.cut(0)
        cut_at = time.time()
        bound = COLLECTIVE_TIMEOUT + LOST_MARGIN
        codes, ended = _wait_exits(tasks[1:], bound + 30)  # past the bound: a hang is seen
        survivors = {}
        for i, code, end in zip((1, 2), codes, ended):
            path = tmp_path / f"worker{i}.json"
            survivors[i] = _read(tmp_path, f"worker{i}") if path.exists() else None
            after = "still running" if end is None else f"exited {end - cut_at:.1f} s"
            raised = survivors[i] and f"raised {survivors[i]['time'] - cut_at:.1f} s, "
            print(f"worker {i}: {raised}{after} after the cut (status {code}): {survivors[i]}")
        for i, code, end in zip((1, 2), codes, ended):
            survivor = survivors[i]
            assert end is not None, f"worker {i} still running {bound + 30} s after the cut"
            assert survivor is not None, f"worker {i} ended (status {code}) without an error"
            assert survivor["error"] in ("UnavailableError", "DeadlineExceededError"), survivor
            assert "worker 0" in survivor["message"], survivor
            assert survivor["time"] - cut_at < bound, survivor
            assert end - cut_at < bound + 10
        assert codes == [1, 1]  # the exit hook's status, not JAX's abort (-6)
