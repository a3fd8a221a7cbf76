"""Before JAX starts, every worker reports in at the coordinator's port (``_roll_call``).

Without it, a task that never starts made JAX wait out the whole timeout in silence and
then abort every process from C++ (exit status 134, "another task died"); two tasks
given different clusters or the same index failed later in gloo, or hung. The roll call
itself is tested here on threads; one test runs a real worker alone through
``MultiWorkerMirroredStrategy``.
"""

import json
import logging
import os
import socket
import subprocess
import sys
import textwrap
import threading
import time

import pytest

import keras_dist as kd
from keras_dist import _roll_call
from keras_dist._roll_call import roll_call

NAMES = ["worker 0", "worker 1", "worker 2"]


def _address():
    return f"127.0.0.1:{kd.testing.pick_unused_port()}"


class _Task(threading.Thread):
    """One process's roll call on a thread: what it raised, if anything."""

    def __init__(self, address, process_id, cluster="spec", num_processes=2, timeout=20):
        super().__init__(daemon=True)
        self.args_ = (address, num_processes, process_id, cluster, timeout, NAMES)
        self.error = None
        self.start()

    def run(self):
        try:
            roll_call(*self.args_)
        except Exception as error:  # noqa: BLE001 - the test looks at it
            self.error = error

    def result(self):
        self.join(30)
        assert not self.is_alive(), "the roll call did not return"
        return self.error


def test_everyone_present_in_any_order():
    address = _address()
    late_coordinator = [_Task(address, i, num_processes=3) for i in (2, 1)]
    time.sleep(0.5)  # the others knock on a closed port first, and ask again
    assert _Task(address, 0, num_processes=3).result() is None
    assert [t.result() for t in late_coordinator] == [None, None]
    # The port is free again for JAX's coordination service (no TIME_WAIT held by us).
    host, port = address.split(":")
    with socket.socket() as probe:
        probe.bind((host, int(port)))


def test_a_missing_task_is_named_after_the_timeout(caplog, monkeypatch):
    monkeypatch.setattr(_roll_call, "LOG_EVERY", 0.5)
    address = _address()
    present = _Task(address, 1, num_processes=3, timeout=3)
    began = time.monotonic()
    with caplog.at_level(logging.WARNING, "keras_dist"):
        with pytest.raises(kd.errors.UnavailableError, match="worker 2 did not join") as raised:
            roll_call(address, 3, 0, "spec", 2, NAMES)
    assert 1.9 < time.monotonic() - began < 10
    assert raised.value.lost_tasks == ("worker 2",)
    assert "Received: 2 of 3 tasks" in str(raised.value)
    # While it waited, it said for whom.
    assert "worker 0 waits for worker 2 to join the cluster" in caplog.text
    # The one that came in is not left hanging: it asks again until its own timeout.
    error = present.result()
    assert isinstance(error, kd.errors.UnavailableError), error


def test_a_missing_coordinator_is_named_by_the_others():
    address = _address()
    began = time.monotonic()
    with pytest.raises(kd.errors.UnavailableError, match="worker 0 .the coordinator") as raised:
        roll_call(address, 2, 1, "spec", 2, NAMES)
    assert 1.9 < time.monotonic() - began < 10
    assert raised.value.lost_tasks == ("worker 0",)
    assert address in str(raised.value)


def test_a_program_holding_the_coordinators_port_is_not_a_silent_wait(caplog, monkeypatch):
    # Something else listens there (a stale run): it takes the report and never answers.
    # The worker waited out its whole timeout (600 s by default) without a line.
    monkeypatch.setattr(_roll_call, "LOG_EVERY", 0.5)
    address = _address()
    host, port = address.split(":")
    with socket.create_server((host, int(port))) as stale:
        stale.settimeout(0.2)
        accepted = []

        def take_and_hold():
            while True:
                try:
                    accepted.append(stale.accept()[0])
                except (TimeoutError, OSError):
                    if stale.fileno() < 0:
                        return

        threading.Thread(target=take_and_hold, daemon=True).start()
        with caplog.at_level(logging.WARNING, "keras_dist"):
            with pytest.raises(kd.errors.UnavailableError, match="never answered") as raised:
                roll_call(address, 2, 1, "spec", 2.5, NAMES)
    assert raised.value.lost_tasks == ("worker 0",)
    assert f"worker 1 reported in to worker 0 at {address} and waits for its answer" in caplog.text
    for connection in accepted:
        connection.close()


def test_another_cluster_is_refused_on_both_sides():
    address = _address()
    other = _Task(address, 1, cluster='{"worker": ["a:1", "c:3"]}')
    with pytest.raises(ValueError, match="another cluster") as raised:
        roll_call(address, 2, 0, '{"worker": ["a:1", "b:2"]}', 20, NAMES)
    assert '"b:2"' in str(raised.value) and '"c:3"' in str(raised.value)
    assert isinstance(other.result(), ValueError)
    assert str(other.result()) == str(raised.value)


def test_two_tasks_with_one_index_are_refused():
    address = _address()
    first = _Task(address, 1, num_processes=3)
    time.sleep(0.3)
    second = _Task(address, 1, num_processes=3)
    with pytest.raises(ValueError, match="Two tasks reported in as worker 1"):
        roll_call(address, 3, 0, "spec", 20, NAMES)
    errors = [first.result(), second.result()]
    assert all(isinstance(e, ValueError) for e in errors), errors


def test_two_tasks_given_index_0_are_refused_on_both():
    # The second cannot take the coordinator's port: it said only that, while the first
    # waited out its whole timeout for a worker 1 that never came.
    address = _address()
    first = _Task(address, 0, num_processes=3)
    time.sleep(0.5)
    began = time.monotonic()
    with pytest.raises(ValueError, match="Two tasks reported in as worker 0"):
        roll_call(address, 3, 0, "spec", 20, NAMES)
    error = first.result()
    assert isinstance(error, ValueError) and "worker 0" in str(error), error
    assert time.monotonic() - began < 10


def _connect(address, timeout=10):
    host, port = address.split(":")
    deadline = time.monotonic() + timeout
    while True:
        try:
            return socket.create_connection((host, int(port)))
        except OSError:
            assert time.monotonic() < deadline
            time.sleep(0.05)


def test_a_task_that_restarted_before_the_roll_was_complete_is_taken_again():
    # A cluster manager restarts a task that died after reporting in: not a repeated index.
    address = _address()
    coordinator = _Task(address, 0, num_processes=3)
    report = {"protocol": _roll_call._PROTOCOL, "process_id": 1, "num_processes": 3}
    with _connect(address) as first_life:
        first_life.sendall(json.dumps(dict(report, cluster="spec")).encode() + b"\n")
        time.sleep(0.5)  # taken: process 0 now waits for worker 2
    second_life = _Task(address, 1, num_processes=3)
    time.sleep(0.5)  # it reports before worker 2 completes the roll
    assert _Task(address, 2, num_processes=3).result() is None
    assert second_life.result() is None
    assert coordinator.result() is None


def test_a_malformed_report_is_refused_clearly():
    address = _address()
    coordinator = _Task(address, 0)
    report = {"protocol": _roll_call._PROTOCOL, "process_id": [1], "num_processes": 2}
    with _connect(address) as connection:
        connection.sendall(json.dumps(dict(report, cluster="spec")).encode() + b"\n")
        answer = json.loads(_roll_call._read_line(connection))
    assert "outside this cluster of 2. Received: process_id=[1]" in answer["error"]
    assert isinstance(coordinator.result(), ValueError)


def test_a_stranger_on_the_port_is_ignored():
    address = _address()
    coordinator = _Task(address, 0)
    with _connect(address) as stranger:
        stranger.sendall(b"GET / HTTP/1.1\r\n\r\n")
        assert _Task(address, 1).result() is None
    assert coordinator.result() is None


_ALONE = textwrap.dedent(
    """
    import json, os, sys
    os.environ["TF_CONFIG"] = json.dumps({
        "cluster": {"worker": [sys.argv[1], sys.argv[2]]},
        "task": {"type": "worker", "index": 0},
    })
    import keras_dist as kd
    options = kd.experimental.CommunicationOptions(timeout_seconds=3)
    try:
        kd.MultiWorkerMirroredStrategy(communication_options=options)
    except kd.errors.UnavailableError as error:
        print("raised", json.dumps(list(error.lost_tasks)), error, flush=True)
        sys.exit(3)
    """
)


def test_a_worker_alone_raises_naming_the_missing_one_instead_of_jaxs_abort(tmp_path):
    script = tmp_path / "alone.py"
    script.write_text(_ALONE)
    addresses = [_address(), _address()]
    env = dict(os.environ, KERAS_BACKEND="jax", JAX_PLATFORMS="cpu")
    began = time.monotonic()
    done = subprocess.run(
        [sys.executable, str(script), *addresses],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    output = done.stdout + done.stderr
    # Before: JAX's C++ abort (status 134) once its timeout passed, naming nobody.
    assert done.returncode == 3, output
    assert 'raised ["worker 1"] worker 1 did not join the cluster within 3 s' in output, output
    assert time.monotonic() - began < 60


_BAD_ADDRESSES = textwrap.dedent(
    """
    import json, os, sys
    import keras_dist as kd
    for address, index in [("127.0.0.1:abc", 0), ("127.0.0.1:-5", 1), ("127.0.0.1", 0),
                           ("127.0.0.1:99999", 1)]:
        os.environ["TF_CONFIG"] = json.dumps({
            "cluster": {"worker": [address, "127.0.0.1:1"]},
            "task": {"type": "worker", "index": index},
        })
        try:
            kd.MultiWorkerMirroredStrategy()
        except ValueError as error:
            print(error, flush=True)
    """
)


def test_a_coordinator_address_without_a_port_number_is_refused_at_once(tmp_path):
    # Before: gRPC crashed (status 139), JAX aborted from C++ after its timeout, or
    # JAX raised IndexError; TF refuses them with InvalidArgumentError at once.
    script = tmp_path / "bad.py"
    script.write_text(_BAD_ADDRESSES)
    env = dict(os.environ, KERAS_BACKEND="jax", JAX_PLATFORMS="cpu")
    done = subprocess.run(
        [sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=120
    )
    lines = done.stdout.splitlines()
    assert done.returncode == 0, done.stdout + done.stderr
    assert len(lines) == 4, done.stdout + done.stderr
    for line, address in zip(
        lines, ["127.0.0.1:abc", "127.0.0.1:-5", "127.0.0.1", "127.0.0.1:99999"]
    ):
        assert line.startswith("The coordinator address must be host:port"), line
        assert "(the address of worker 0, in the cluster spec or TF_CONFIG)" in line
        assert line.endswith(f"Received: {address!r}")
