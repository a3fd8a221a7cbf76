"""The parameter-server runtime: message bytes, the cluster token, the ps store, servers.

The security case: a request without the cluster token is refused
and logged before anything in it is decoded; the test sends a pickle that
would set an environment variable when loaded and checks it never was, and,
as a control, that the same request with the token does load it.
"""

import json
import logging
import os
import pickle
import shutil
import subprocess
import sys
import threading
import time

import grpc
import keras
import ml_dtypes
import numpy as np
import pytest

import keras_dist as kd
from keras_dist import errors
from keras_dist.cluster_resolver import ClusterSpec
from keras_dist.parameter_server.rpc import _wire
from keras_dist.parameter_server.rpc._auth import TOKEN_METADATA_KEY
from keras_dist.parameter_server.rpc._transport import RpcClient
from keras_dist.parameter_server.rpc._transport import RpcServer
from keras_dist.parameter_server.variables._client import Location
from keras_dist.parameter_server.variables._client import ParameterServers
from keras_dist.parameter_server.variables._client import Shard

pytestmark = pytest.mark.timeout(60)


def _cluster(num_ps=1, num_workers=1):
    port = kd.testing.pick_unused_port
    return {
        "ps": [f"127.0.0.1:{port()}" for _ in range(num_ps)],
        "worker": [f"127.0.0.1:{port()}" for _ in range(num_workers)],
    }


def test_messages_carry_raw_buffers():
    arrays = [
        np.arange(6, dtype="float32").reshape(2, 3),
        np.float64(2.5),
        np.zeros((0, 4), "int8"),
        np.array([1.5, -2], dtype=ml_dtypes.bfloat16),
    ]
    header, decoded, blob = _wire.decode(_wire.encode({"op": "x", "n": 1}, arrays, b"tail"))
    assert header == {"op": "x", "n": 1} and blob == b"tail"
    for original, back in zip(arrays, decoded):
        assert back.dtype == np.asarray(original).dtype
        assert back.shape == np.shape(original)
        np.testing.assert_array_equal(back, original)
    with pytest.raises(ValueError, match="Not a keras_dist parameter-server message"):
        _wire.decode(b"GET / HTTP/1.1")


def test_request_without_token_is_refused_and_never_unpickled(caplog):
    cluster = _cluster()
    worker = kd.Server(cluster, job_name="worker", task_index=0)
    try:
        marker = "KERAS_DIST_TEST_UNPICKLED"
        os.environ.pop(marker, None)
        payload = pickle.dumps(_SetsEnvironment(marker))
        header = {"op": "dataset", "dataset_id": "d", "worker_index": 0}
        stranger = RpcClient(cluster["worker"][0], name="worker0", token="not-the-token")
        with pytest.raises(errors.UnauthenticatedError, match="refused"):
            stranger.call(header, (), payload, timeout=10)
        assert marker not in os.environ
        assert worker.refused_requests == 1
        assert "without the cluster token" in caplog.text
        # Control: with the token the same request is decoded (and the pickle loaded).
        member = RpcClient(cluster["worker"][0], name="worker0")
        with pytest.raises(errors.OpError):
            member.call(header, (), payload, timeout=10)
        assert os.environ.pop(marker) == "1"
    finally:
        worker.stop()


def _resident_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


@pytest.mark.skipif(not os.path.exists("/proc/self/statm"), reason="reads Linux's /proc")
def test_a_stranger_s_huge_request_is_refused_before_the_server_reads_it():
    # Before, grpcio received and assembled the whole message before the token was
    # checked: 512 MiB from a client without the token grew the server by 512 MiB.
    cluster = _cluster()
    ps = kd.Server(cluster, job_name="ps", task_index=0)
    try:
        before = _resident_mib()
        code = (
            "import grpc, sys\n"
            f"channel = grpc.insecure_channel({cluster['ps'][0]!r}, "
            "options=[('grpc.max_send_message_length', -1)])\n"
            "call = channel.unary_unary('/keras_dist.ps.Task/Call')\n"
            "try:\n"
            "    call(b'x' * (256 * 2**20), timeout=60)\n"
            "except grpc.RpcError as error:\n"
            "    print(error.code().name)\n"
        )
        result = subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, timeout=120
        )
        assert result.stdout.strip() == "UNAUTHENTICATED", result.stdout + result.stderr
        assert ps.refused_requests == 1
        assert _resident_mib() - before < 64  # not the 256 MiB it was sent
    finally:
        ps.stop()


def test_oversized_and_damaged_requests_get_named_errors_and_the_server_serves_on(
    monkeypatch,
):
    monkeypatch.setenv("KERAS_DIST_MAX_MESSAGE_BYTES", str(2**20))  # a 1 MiB cap
    monkeypatch.setenv("KERAS_DIST_CLUSTER_TOKEN", "cap-test")
    cluster = _cluster()
    ps = kd.Server(cluster, job_name="ps", task_index=0)
    client = RpcClient(cluster["ps"][0], name="/job:ps/replica:0/task:0")
    try:
        with pytest.raises(errors.InvalidArgumentError, match="KERAS_DIST_MAX_MESSAGE_BYTES"):
            client.call({"op": "create", "keys": ["big"]}, [np.zeros(2**19)])  # 4 MiB
        # A message cut short, and one that is not ours, from a caller with the token.
        raw = grpc.insecure_channel(cluster["ps"][0]).unary_unary("/keras_dist.ps.Task/Call")
        metadata = ((TOKEN_METADATA_KEY, "cap-test"),)
        whole = _wire.encode({"op": "create", "keys": ["v"]}, [np.zeros(1000)])
        for damaged in (whole[: len(whole) // 2], b"not a message at all"):
            header, _, _ = _wire.decode(raw(damaged, timeout=10, metadata=metadata))
            assert header["error"] == "InvalidArgumentError", header
            assert "not a whole keras_dist message" in header["message"]
        # The server serves on, and nothing was stored.
        client.call({"op": "create", "keys": ["small"]}, [np.zeros(4)])
        with pytest.raises(errors.NotFoundError):
            client.call({"op": "read", "keys": ["big"]})
    finally:
        client.close()
        ps.stop()


def test_the_message_cap_is_checked():
    from keras_dist.parameter_server.rpc._transport import max_message_bytes

    os.environ["KERAS_DIST_MAX_MESSAGE_BYTES"] = "12"
    try:
        with pytest.raises(ValueError, match="from 1024 to 2147483647. Received: .*'12'"):
            max_message_bytes()
    finally:
        del os.environ["KERAS_DIST_MAX_MESSAGE_BYTES"]


class _SetsEnvironment:
    def __init__(self, name):
        self.name = name

    def __reduce__(self):
        return (exec, (f"import os; os.environ[{self.name!r}] = '1'",))


def test_servers_listen_only_on_the_spec_address():
    cluster = _cluster()
    server = kd.Server(cluster, job_name="ps", task_index=0)
    try:
        port = int(cluster["ps"][0].rsplit(":", 1)[1])
        listening = []
        for table in ("/proc/net/tcp", "/proc/net/tcp6"):
            if not os.path.exists(table):
                continue
            with open(table) as f:
                for line in f.readlines()[1:]:
                    local, state = line.split()[1], line.split()[3]
                    address, hex_port = local.split(":")
                    if int(hex_port, 16) == port and state == "0A":  # LISTEN
                        listening.append(address)
        # 127.0.0.1 only (gRPC may bind it as the IPv4-mapped ::ffff:127.0.0.1), never
        # 0.0.0.0 or ::.
        assert listening
        assert set(listening) <= {"0100007F", "0000000000000000FFFF00000100007F"}
    finally:
        server.stop()


class _ForeignClusterSpec:
    """A ``tf.train.ClusterSpec`` as keras_dist sees one (``jobs``, ``as_dict``, ...)."""

    def __init__(self, cluster):
        self._cluster = cluster

    @property
    def jobs(self):
        return list(self._cluster)

    def as_dict(self):
        return self._cluster

    def as_cluster_def(self):
        raise AssertionError("keras_dist reads a foreign cluster spec through as_dict()")


@pytest.mark.parametrize("source", ["stand-in", "tensorflow"])
def test_a_server_takes_a_tf_train_cluster_spec(source):
    # TF's parameter-server tutorial starts its in-process servers this way.
    cluster = _cluster(num_workers=2)
    if source == "tensorflow":
        spec = pytest.importorskip("tensorflow").train.ClusterSpec(cluster)
    else:
        spec = _ForeignClusterSpec(cluster)
    servers = [kd.Server(spec, job_name="worker", task_index=1), kd.Server(spec, "ps", 0)]
    try:
        assert servers[0].cluster_spec == ClusterSpec(cluster)
        assert servers[0].target == f"grpc://{cluster['worker'][1]}"
        client = ParameterServers(ClusterSpec(cluster))
        location = Location((Shard(0, "v", None),), (3,), "float32")
        client.create(location, np.arange(3.0, dtype="float32"))
        np.testing.assert_array_equal(client.read([location])[0], [0.0, 1.0, 2.0])
    finally:
        for server in servers:
            server.stop()


def test_store_updates_are_atomic_per_request():
    cluster = _cluster()
    server = kd.Server(cluster, job_name="ps", task_index=0)
    servers = ParameterServers(ClusterSpec(cluster))
    try:
        location = Location((Shard(0, "counter", None),), (), "int64")
        servers.create(location, np.int64(0))

        def bump():
            for _ in range(100):
                servers.update([(location, "add", np.int64(1))])

        threads = [threading.Thread(target=bump) for _ in range(4)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        assert int(servers.read([location])[0]) == 400
        with pytest.raises(errors.NotFoundError, match="holds no variable"):
            servers.read([Location((Shard(0, "missing", None),), (), "int64")])
    finally:
        servers.close()
        server.stop()


def test_a_step_run_again_is_applied_once_per_ps_task():
    # A worker lost after its step reached a ps task: the coordinator runs the call
    # again elsewhere, with the same run id, and that ps task does not apply it twice.
    cluster = _cluster(num_ps=2)
    ps = [kd.Server(cluster, job_name="ps", task_index=i) for i in range(2)]
    servers = ParameterServers(ClusterSpec(cluster))
    try:
        counters = [Location((Shard(i, f"c{i}", None),), (), "int64") for i in range(2)]
        for location in counters:
            servers.create(location, np.int64(0))
        # The first run reached ps 0 only (the worker died between the requests).
        servers.update([(counters[0], "add", np.int64(1))], run_id="call-7")
        again = servers.update(
            [(location, "add", np.int64(1)) for location in counters],
            read=counters,
            run_id="call-7",
        )
        assert [int(v) for v in again] == [1, 1]
        servers.update([(counters[0], "add", np.int64(1))], run_id="call-8")
        servers.update([(counters[0], "add", np.int64(1))])  # no id: always applied
        assert [int(v) for v in servers.read(counters)] == [3, 1]
    finally:
        servers.close()
        for server in ps:
            server.stop()


def test_a_lost_ps_task_is_unavailable_and_named():
    cluster = _cluster()
    servers = ParameterServers(ClusterSpec(cluster), timeout=5)
    with pytest.raises(errors.UnavailableError) as raised:
        servers.ping(0)
    assert raised.value.lost_tasks == ("/job:ps/replica:0/task:0",)
    assert "/job:ps/replica:0/task:0" in str(raised.value)


def test_server_checks_its_arguments():
    with pytest.raises(ValueError, match="gRPC only"):
        kd.Server(_cluster(), job_name="ps", task_index=0, protocol="rdma", start=False)
    with pytest.raises(ValueError, match="job_name"):
        kd.Server(_cluster(), job_name="trainer", task_index=0, start=False)


def test_stop_ends_each_server_s_join_and_skips_gone_ones():
    # What a chief's program does at exit (parameter_server/_job.py): the job is over.
    from keras_dist.parameter_server._job import stop_servers

    cluster = _cluster(num_ps=1, num_workers=1)
    servers = [kd.Server(cluster, job_name=job, task_index=0) for job in ("ps", "worker")]
    joined = []
    threads = [
        threading.Thread(target=lambda s=s: (s.join(), joined.append(s.job_name))) for s in servers
    ]
    for thread in threads:
        thread.start()
    gone = ("/job:worker/replica:0/task:1", f"127.0.0.1:{kd.testing.pick_unused_port()}")
    targets = [(s.task_name, cluster[s.job_name][0]) for s in servers] + [gone]
    stop_servers(targets, timeout=10)
    for thread in threads:
        thread.join(timeout=10)
    assert sorted(joined) == ["ps", "worker"]
    with pytest.raises(errors.UnavailableError):  # no longer serving
        RpcClient(cluster["ps"][0], name="ps").call({"op": "ping"}, timeout=2)


def _certificate(tmp_path):
    key, cert = tmp_path / "key.pem", tmp_path / "cert.pem"
    subprocess.run(
        [
            "openssl",
            "req",
            "-x509",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-days",
            "1",
            "-subj",
            "/CN=localhost",
            "-addext",
            "subjectAltName=DNS:localhost,IP:127.0.0.1",
            "-keyout",
            str(key),
            "-out",
            str(cert),
        ],
        check=True,
        capture_output=True,
    )
    return key, cert


needs_openssl = pytest.mark.skipif(
    shutil.which("openssl") is None, reason="needs openssl for a test certificate"
)


@needs_openssl
def test_tls_credentials(tmp_path):
    key, cert = _certificate(tmp_path)
    server_credentials = grpc.ssl_server_credentials([(key.read_bytes(), cert.read_bytes())])
    address = f"127.0.0.1:{kd.testing.pick_unused_port()}"
    server = RpcServer(
        address,
        lambda h, a, b: ({"echo": h["op"]}, a, b),
        name="tls",
        credentials=server_credentials,
    )
    server.start()
    try:
        client = RpcClient(
            address, name="tls", credentials=grpc.ssl_channel_credentials(cert.read_bytes())
        )
        header, arrays, _ = client.call({"op": "hello"}, [np.arange(3)], timeout=10)
        assert header == {"echo": "hello"} and arrays[0].tolist() == [0, 1, 2]
        plain = RpcClient(address, name="tls")
        with pytest.raises(errors.UnavailableError):
            plain.call({"op": "hello"}, timeout=5)
    finally:
        server.stop()


@needs_openssl
def test_tls_from_the_environment_covers_the_whole_cluster(tmp_path, monkeypatch):
    key, cert = _certificate(tmp_path)
    monkeypatch.setenv("KERAS_DIST_TLS_CERT", str(cert))
    monkeypatch.setenv("KERAS_DIST_TLS_KEY", str(key))
    resolver = kd.testing.create_in_process_cluster(num_workers=1, num_ps=1)
    strategy = kd.ParameterServerStrategy(resolver)
    coordinator = kd.coordinator.ClusterCoordinator(strategy)
    with strategy.scope():
        v = keras.Variable(1.0)
    coordinator.schedule(lambda: v.assign_add(2.0))
    coordinator.join()
    assert float(v.numpy()) == 3.0
    coordinator.stop()
    monkeypatch.delenv("KERAS_DIST_TLS_CERT")
    plain = RpcClient(resolver.cluster_spec().task_address("ps", 0), name="ps0")
    with pytest.raises(errors.UnavailableError):
        plain.call({"op": "ping"}, timeout=5)


def test_a_task_process_keeps_its_step_buffers(monkeypatch):
    from keras_dist.parameter_server.tasks._memory import is_own_task
    from keras_dist.parameter_server.tasks._memory import keep_freed_buffers

    monkeypatch.setenv("TF_CONFIG", json.dumps({"task": {"type": "ps", "index": 1}}))
    assert is_own_task("ps", 1)
    assert not is_own_task("ps", 0) and not is_own_task("worker", 1)
    monkeypatch.setenv("TF_CONFIG", "not json")
    assert not is_own_task("ps", 1)
    monkeypatch.setenv("MALLOC_TRIM_THRESHOLD_", "1000")
    assert not keep_freed_buffers()  # the user's own glibc settings win


def test_a_task_started_by_hand_without_the_token_says_so(monkeypatch, caplog):
    cluster = _cluster()
    monkeypatch.delenv("KERAS_DIST_CLUSTER_TOKEN", raising=False)
    monkeypatch.setenv(
        "TF_CONFIG", json.dumps({"cluster": cluster, "task": {"type": "ps", "index": 0}})
    )
    monkeypatch.setattr(
        "keras_dist.parameter_server.tasks._server.keep_freed_buffers", lambda: None
    )
    with caplog.at_level(logging.INFO, logger="keras_dist.ps"):
        ps = kd.Server(cluster, job_name="ps", task_index=0)
    try:
        warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
        assert any("starts without KERAS_DIST_CLUSTER_TOKEN" in r.getMessage() for r in warnings)
        stranger = RpcClient(cluster["ps"][0], name="ps0", token="another-process-token")
        with pytest.raises(errors.UnauthenticatedError, match="KERAS_DIST_CLUSTER_TOKEN"):
            stranger.call({"op": "ping"}, timeout=10)
        assert "This task has no KERAS_DIST_CLUSTER_TOKEN itself" in caplog.text
    finally:
        ps.stop()


def test_a_task_restarted_at_its_address_is_reached_at_once():
    # While a task is down, every failed connection lengthens the channel's wait
    # before its next try (to 1 s); a call in that wait must still reach the task
    # that came back, not fail at once as if it were still gone.
    address = _cluster()["ps"][0]
    client = RpcClient(address, name="/job:ps/replica:0/task:0")
    down = time.monotonic()
    while time.monotonic() - down < 1.5:  # failed tries until the wait is at its longest
        with pytest.raises(errors.UnavailableError):
            client.call({"op": "ping"}, timeout=5)
    server = RpcServer(address, lambda header, arrays, blob: ({"pong": True}, [], b""), name="ps0")
    server.start()
    try:
        header, _, _ = client.call({"op": "ping"}, timeout=5)
        assert header == {"pong": True}
    finally:
        server.stop()
        client.close()
