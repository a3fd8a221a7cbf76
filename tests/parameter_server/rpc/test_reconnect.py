"""A ps task's connection lost for a while: calls are sent again, and applied once.

Faults are injected into the transport of a real client and server on 127.0.0.1: a
request that reached the ps task and was applied, its reply lost (the connection
dropped, as gRPC does after ~5 s of a silent link); a request lost before it left; a
task unreachable for longer than the client reconnects. (``tests/hosts`` cuts a real
link between hosts of their own.)
"""

import time

import grpc
import numpy as np
import pytest

import keras_dist as kd
from keras_dist import errors
from keras_dist.cluster_resolver import ClusterSpec
from keras_dist.parameter_server.rpc import _wire
from keras_dist.parameter_server.variables._client import Location
from keras_dist.parameter_server.variables._client import ParameterServers
from keras_dist.parameter_server.variables._client import Shard

pytestmark = pytest.mark.timeout(60)


class _Dropped(grpc.RpcError):
    """What gRPC raises for a call on a connection that died (not a refused one)."""

    def code(self):
        return grpc.StatusCode.UNAVAILABLE

    def details(self):
        return "Stream removed (recvmsg:Connection timed out (110))"


class _Flaky:
    """A client's gRPC method whose first ``update`` calls fail as ``faults`` say.

    ``"after"``: the request reaches the task (and is applied), the reply is lost.
    ``"before"``: the request is lost before it leaves. ``"always"``: every call fails.
    """

    def __init__(self, method, faults):
        self._method, self.faults, self.updates = method, list(faults), 0

    def __call__(self, request, **kwargs):
        header = _wire.decode(request)[0]
        if header["op"] == "update" or self.faults == ["always"]:
            self.updates += header["op"] == "update"
            fault = self.faults[0] if self.faults == ["always"] else None
            if fault is None and self.faults:
                fault = self.faults.pop(0)
            if fault in ("before", "always"):
                raise _Dropped()
            if fault == "after":
                self._method(request, **kwargs)  # applied on the ps task...
                raise _Dropped()  # ...and the reply never comes back
        return self._method(request, **kwargs)


@pytest.fixture
def ps_task():
    port = kd.testing.pick_unused_port
    cluster = {"ps": [f"127.0.0.1:{port()}"], "worker": [f"127.0.0.1:{port()}"]}
    server = kd.Server(cluster, job_name="ps", task_index=0)
    servers = ParameterServers(ClusterSpec(cluster), timeout=10, retry_seconds=10)
    counter = Location((Shard(0, "counter", None),), (), "int64")
    servers.create(counter, np.int64(0))
    yield servers, counter
    servers.close()
    server.stop()


@pytest.mark.parametrize("run_id", ["call-1", None])
def test_an_update_applied_before_its_reply_was_lost_is_not_applied_again(
    ps_task, monkeypatch, run_id
):
    servers, counter = ps_task
    client = servers.clients[0]
    flaky = _Flaky(client._method, ["after", "before", "after"])
    monkeypatch.setattr(client, "_method", flaky)
    started = time.monotonic()
    value = servers.update([(counter, "add", np.int64(1))], read=[counter], run_id=run_id)
    # Sent four times (applied, its reply lost; lost on the way; answered from its id,
    # the reply lost; answered from its id): applied once.
    assert flaky.updates == 4 and flaky.faults == []
    assert int(value[0]) == 1
    assert int(servers.read([counter])[0]) == 1
    assert time.monotonic() - started < 5  # pauses of 0.1, 0.2 and 0.4 s
    # The next update is a new one, applied.
    servers.update([(counter, "add", np.int64(1))], run_id=None if run_id is None else "call-2")
    assert int(servers.read([counter])[0]) == 2


def test_a_ps_task_unreachable_past_the_retry_window_is_named(ps_task, monkeypatch):
    servers, counter = ps_task
    client = servers.clients[0]
    client.retry_seconds = 1.5
    monkeypatch.setattr(client, "_method", _Flaky(client._method, ["always"]))
    started = time.monotonic()
    with pytest.raises(errors.UnavailableError, match="stayed unreachable") as raised:
        servers.update([(counter, "add", np.int64(1))])
    assert 1.5 <= time.monotonic() - started < 4
    assert raised.value.lost_tasks == ("/job:ps/replica:0/task:0",)
    assert "/job:ps/replica:0/task:0" in str(raised.value)


def test_a_refused_connection_is_a_lost_task_at_once():
    # Nothing serves the address (the ps process is gone): no reconnecting for 30 s.
    port = kd.testing.pick_unused_port()
    servers = ParameterServers(ClusterSpec({"ps": [f"127.0.0.1:{port}"]}), retry_seconds=30)
    try:
        started = time.monotonic()
        with pytest.raises(errors.UnavailableError) as raised:
            servers.read([Location((Shard(0, "v", None),), (), "int64")])
        assert time.monotonic() - started < 5
        assert raised.value.lost_tasks == ("/job:ps/replica:0/task:0",)
    finally:
        servers.close()
