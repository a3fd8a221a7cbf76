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
