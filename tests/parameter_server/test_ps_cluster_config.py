"""A ``ParameterServerStrategy`` given a bad cluster: a clear error, never a silent wait."""

import json
import logging

import pytest

import keras_dist as kd
from keras_dist import errors
from keras_dist._launch._cluster import pick_unused_port
from keras_dist.parameter_server.scheduling import _cluster_coordinator
from keras_dist.parameter_server.variables import _client
from keras_dist.parameter_server.variables._client import ParameterServers

pytestmark = pytest.mark.timeout(60)


def _cluster():
    ports = [pick_unused_port() for _ in range(3)]
    return {
        "chief": [f"127.0.0.1:{ports[0]}"],
        "worker": [f"127.0.0.1:{ports[1]}"],
        "ps": [f"127.0.0.1:{ports[2]}"],
    }


def test_a_task_outside_its_cluster_raises_at_once(monkeypatch):
    # Chief 3 of a one-chief cluster waited 120 s for the ps tasks before failing.
    monkeypatch.setenv(
        "TF_CONFIG", json.dumps({"cluster": _cluster(), "task": {"type": "chief", "index": 3}})
    )
    resolver = kd.cluster_resolver.TFConfigClusterResolver()
    with pytest.raises(ValueError, match=r"task \(chief, index 3\) is not in its cluster"):
        kd.ParameterServerStrategy(resolver)


def test_waiting_for_a_ps_task_that_never_starts_says_so(monkeypatch, caplog):
    monkeypatch.setattr(_client, "_WAIT_NOTE_EVERY", 0.3)
    cluster = _cluster()
    servers = ParameterServers(kd.cluster_resolver.ClusterSpec(cluster))
    try:
        with caplog.at_level(logging.WARNING, logger="keras_dist.ps"):
            with pytest.raises(errors.UnavailableError):
                servers.wait_until_ready(3.5)
    finally:
        servers.close()
    notes = [r.getMessage() for r in caplog.records if "Waiting for ps task 0" in r.getMessage()]
    assert notes and cluster["ps"][0] in notes[0]


class _Pinged:
    """Ps tasks whose pings fail as listed, then answer; and the queue that hears of it."""

    def __init__(self, failures):
        self.failures = list(failures)
        self.num_ps = 1
        self.clients = [type("Client", (), {"name": "/job:ps/replica:0/task:0"})()]
        self.errors, self.stopped, self.pings = [], False, 0

    def ping(self, task, timeout):
        self.pings += 1
        if self.failures:
            raise self.failures.pop(0)
        self.stopped = self.pings >= 12  # enough rounds: the watch ends

    def set_error(self, error):
        self.errors.append(error)


def test_a_ps_slow_to_answer_is_busy_and_one_silent_too_long_or_unreachable_is_lost(monkeypatch):
    monkeypatch.setattr(_cluster_coordinator, "PS_PROBE_INTERVAL", 0.01)
    monkeypatch.setattr(_cluster_coordinator, "PS_STUCK_AFTER", 0.5)
    late = kd.errors.DeadlineExceededError("did not complete in time", ())
    # Two missed pings, then answers: a busy task, training goes on.
    busy = _Pinged([late, late])
    _cluster_coordinator._watch_ps(busy, busy, lambda: True)
    assert busy.errors == [] and busy.pings == 12
    # Silent for longer than PS_STUCK_AFTER: lost.
    stuck = _Pinged([late] * 1000)
    _cluster_coordinator._watch_ps(stuck, stuck, lambda: True)
    (error,) = stuck.errors
    assert isinstance(error, kd.errors.UnavailableError) and "did not complete" in str(error)
    # Unreachable: lost at the first ping.
    gone = _Pinged([kd.errors.UnavailableError("connection refused", ())])
    _cluster_coordinator._watch_ps(gone, gone, lambda: True)
    assert len(gone.errors) == 1 and gone.pings == 1
