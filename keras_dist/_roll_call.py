"""The roll call before ``jax.distributed.initialize``: every task present, on one cluster.

JAX's coordination service, started with a task missing, waits out its whole
timeout in silence and then aborts every process from C++ ("another task
died"), with no word about which task it waited for. Tasks started with
different clusters (two TF_CONFIGs that disagree, or two tasks given the same
index) fail in gloo later, or hang. So before JAX starts, process 0 opens the
coordinator's port itself and every other process reports in there, with its
process id and the cluster it was given:

* while someone is missing, process 0 logs who, every ``LOG_EVERY`` seconds,
  and past the timeout raises ``UnavailableError`` naming them (the others
  raise it too, naming process 0, if it never answers);
* a process whose cluster differs from process 0's, or whose id another
  process already took, is refused, and both sides raise ``ValueError`` saying
  what differs.

Once everyone is in, process 0 answers them all, closes the port, and JAX's
service binds it. A message is one line of JSON each way.

>>> import threading
>>> import keras_dist as kd
>>> address = f"127.0.0.1:{kd.testing.pick_unused_port()}"
>>> other = threading.Thread(target=roll_call, args=(address, 2, 1, "spec", 30))
>>> other.start(); roll_call(address, 2, 0, "spec", 30); other.join()
"""

import json
import logging
import queue
import socket
import threading
import time

from keras_dist.errors import UnavailableError

_log = logging.getLogger("keras_dist")

LOG_EVERY = 30.0  # seconds between "still waiting for ..." lines
_PROTOCOL = "keras_dist roll call 1"
_LINE_LIMIT = 1 << 20  # a report is small; a stranger's endless stream is cut here


def roll_call(coordinator_address, num_processes, process_id, cluster, timeout, names=None):
    """Returns once all ``num_processes`` processes reported in with the same ``cluster``.

    ``cluster`` is a string every process of the cluster computes alike (its
    cluster spec as JSON); ``names`` are the tasks' names in process order
    (``"worker 1"``), for the messages.
    """
    names = list(names or (f"process {i}" for i in range(num_processes)))
    parsed = split_host_port(coordinator_address)
    if parsed is None:
        return  # not host:port (``_distributed_runtime.initialize`` refuses it first)
    host, port = parsed
    deadline = time.monotonic() + timeout
    if process_id == 0:
        _call_the_roll(host, port, num_processes, cluster, deadline, names, timeout)
    else:
        report = _report(process_id, num_processes, cluster)
        _report_in(host, port, report, deadline, names, timeout, coordinator_address)


def _report(process_id, num_processes, cluster) -> dict:
    """What a task sends the coordinator's port when it reports in."""
    return {
        "protocol": _PROTOCOL,
        "process_id": process_id,
        "num_processes": num_processes,
        "cluster": cluster,
    }


# --- process 0 ---------------------------------------------------------------------------


def _call_the_roll(host, port, num_processes, cluster, deadline, names, timeout):
    present: dict = {}  # process id -> its connection
    reports: queue.SimpleQueue = queue.SimpleQueue()
    try:
        server = _listen(port)
    except OSError:
        # Another task given index 0 may hold the port: tell it (both then raise).
        _report_as_a_second_coordinator(host, port, num_processes, cluster)
        raise
    with server:
        server.settimeout(0.2)
        next_log = time.monotonic() + LOG_EVERY
        try:
            while len(present) < num_processes - 1:
                now = time.monotonic()
                if now >= deadline:
                    missing = [names[i] for i in range(1, num_processes) if i not in present]
                    raise UnavailableError(
                        f"{_listing(missing)} did not join the cluster within {timeout:g} s: "
                        f"{names[0]} (this process) waited at port {port}. Start "
                        "every task of the cluster, each with its own index (two tasks "
                        "given one index leave another index missing), or raise "
                        "CommunicationOptions(timeout_seconds=...) if they start slowly. "
                        f"Received: {len(present) + 1} of {num_processes} tasks",
                        tuple(missing),
                    )
                if now >= next_log:
                    missing = [names[i] for i in range(1, num_processes) if i not in present]
                    _log.warning(
                        "%s waits for %s to join the cluster (%d s of %g s).",
                        names[0],
                        _listing(missing),
                        int(now - (deadline - timeout)),
                        timeout,
                    )
                    next_log = now + LOG_EVERY
                try:
                    connection, _ = server.accept()
                except (TimeoutError, BlockingIOError):
                    pass
                else:
                    threading.Thread(
                        target=_read_report, args=(connection, reports), daemon=True
                    ).start()
                while not reports.empty():
                    connection, report = reports.get()
                    _take(report, connection, present, num_processes, cluster, names)
            for connection in present.values():
                _send(connection, {"go": True})
            for connection in present.values():
                _wait_closed(connection)  # the caller closes first: no TIME_WAIT on the port
        finally:
            for connection in present.values():
                connection.close()


def _take(report, connection, present, num_processes, cluster, names):
    """Records one report, or refuses it (and raises) when it is not of this cluster."""
    if not isinstance(report, dict) or report.get("protocol") != _PROTOCOL:
        connection.close()  # not a keras_dist task (a port scanner...): ignored
        return
    process_id, theirs = report.get("process_id"), report.get("cluster")
    if report.get("num_processes") != num_processes or theirs != cluster:
        problem = (
            f"A task reported in with another cluster than {names[0]}'s: every task must "
            "be given the same cluster (TF_CONFIG's `cluster`, the same on every task; only "
            f"`task` differs). Received: {names[0]} has {cluster}; the other task has "
            f"{theirs}"
        )
    elif process_id == 0:
        problem = (
            f"Two tasks reported in as {names[0]}: give each task its own index "
            "(TF_CONFIG's task.index). Received: process id 0 twice (the second could not "
            "take the coordinator's port)"
        )
    elif type(process_id) is not int or not 0 < process_id < num_processes:
        problem = (
            f"A task reported in with a process id outside this cluster of "
            f"{num_processes}. Received: process_id={process_id!r}"
        )
    else:
        if process_id in present and _is_closed(present[process_id]):
            present.pop(process_id).close()  # that task restarted (a cluster manager's retry)
        problem = None
        if process_id in present:
            problem = (
                f"Two tasks reported in as {names[process_id]}: give each task its own "
                f"index (TF_CONFIG's task.index). Received: process id {process_id} twice"
            )
    if problem is not None:
        _send(connection, {"error": problem})
        connection.close()
        for other in present.values():
            _send(other, {"error": problem})
        raise ValueError(problem)
    present[process_id] = connection


def _report_as_a_second_coordinator(host, port, num_processes, cluster) -> None:
    """Reports in as process 0 to whatever holds the port; raises the ``ValueError`` a
    keras_dist coordinator answers with (the same index twice). Returns otherwise."""
    try:
        with socket.create_connection((host, port), timeout=5) as connection:
            _send(connection, _report(0, num_processes, cluster))
            connection.settimeout(5)
            answer = json.loads(_read_line(connection))
    except (OSError, ValueError):
        return  # not a keras_dist task: the port is simply taken
    if isinstance(answer, dict) and "error" in answer:
        raise ValueError(answer["error"])


def _read_report(connection, reports):
    connection.settimeout(30)
    try:
        reports.put((connection, json.loads(_read_line(connection))))
    except (OSError, ValueError):
        connection.close()


# --- the other processes -----------------------------------------------------------------


def _report_in(host, port, report, deadline, names, timeout, coordinator_address):
    started, next_log = time.monotonic(), time.monotonic() + LOG_EVERY
    me, connected = names[report["process_id"]], False

    def note_unanswered():
        _log.warning(
            "%s reported in to %s at %s and waits for its answer (%d s of %g s): the "
            "others have not all joined yet, or another program holds that port.",
            me,
            names[0],
            coordinator_address,
            int(time.monotonic() - started),
            timeout,
        )

    while True:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            held = (
                " (something took the connection there but never answered: check that no "
                "other program holds that port)"
                if connected
                else ""
            )
            raise UnavailableError(
                f"{names[0]} (the coordinator, at {coordinator_address}) did not answer "
                f"within {timeout:g} s{held}, so {me} (this process) "
                "could not join the cluster. Start that task (each task with its own "
                "index: two given one index leave another missing), check the address is "
                "reachable from here, or raise CommunicationOptions(timeout_seconds=...)."
                f" Received: no answer at {coordinator_address}",
                (names[0],),
            )
        if time.monotonic() >= next_log:
            _log.warning(
                "%s waits for %s (the coordinator, at %s) to start (%d s of %g s).",
                names[report["process_id"]],
                names[0],
                coordinator_address,
                int(time.monotonic() - started),
                timeout,
            )
            next_log = time.monotonic() + LOG_EVERY
        try:
            with socket.create_connection((host, port), timeout=min(remaining, 5)) as connection:
                connected = True
                _send(connection, report)
                answer = json.loads(_answer(connection, deadline, note_unanswered))
        except (OSError, ValueError):
            # Not up yet, or process 0 restarted its roll call: ask again.
            time.sleep(min(0.2, max(remaining, 0)))
            continue
        if "error" in answer:
            raise ValueError(answer["error"])
        return


# --- sockets -----------------------------------------------------------------------------


def _listen(port):
    """A server socket on every address at ``port``, where JAX's service binds next."""
    if socket.has_dualstack_ipv6():
        try:
            return socket.create_server(
                ("", port), family=socket.AF_INET6, dualstack_ipv6=True, reuse_port=False
            )
        except OSError:
            pass  # no IPv6 on this machine
    return socket.create_server(("", port))


def _send(connection, message) -> None:
    try:
        connection.sendall(json.dumps(message).encode() + b"\n")
    except OSError:
        pass  # the peer went away; it finds out by itself


def _read_line(connection) -> bytes:
    data = b""
    while not data.endswith(b"\n"):
        chunk = connection.recv(65536)
        if not chunk or len(data) > _LINE_LIMIT:
            raise ConnectionError("the peer closed before a whole message")
        data += chunk
    return data


def _answer(connection, deadline, note) -> bytes:
    """One line from ``connection`` by ``deadline``; ``note()`` every ``LOG_EVERY`` s of
    waiting (the coordinator answers once every task has reported in)."""
    data, next_note = b"", time.monotonic() + LOG_EVERY
    while not data.endswith(b"\n"):
        now = time.monotonic()
        if now >= deadline:
            raise TimeoutError("no answer before the deadline")
        if now >= next_note:
            note()
            next_note = now + LOG_EVERY
        connection.settimeout(max(0.1, min(deadline, next_note) - now))
        try:
            chunk = connection.recv(65536)
        except TimeoutError:
            continue
        if not chunk or len(data) > _LINE_LIMIT:
            raise ConnectionError("the peer closed before a whole message")
        data += chunk
    return data


def _is_closed(connection) -> bool:
    """Whether the peer has closed ``connection`` (it sends nothing until answered)."""
    timeout = connection.gettimeout()
    connection.setblocking(False)
    try:
        return connection.recv(1, socket.MSG_PEEK) == b""
    except BlockingIOError:
        return False
    except OSError:
        return True
    finally:
        connection.settimeout(timeout)


def _wait_closed(connection) -> None:
    connection.settimeout(5)
    try:
        while connection.recv(4096):
            pass
    except OSError:
        pass


def split_host_port(address):
    """``("::", 80)`` for ``"[::]:80"``; None when ``address`` is not ``host:port``."""
    host, _, port = str(address).rpartition(":")
    if not host or not port.isdigit():
        return None
    return host.strip("[]"), int(port)


def _listing(names) -> str:
    return names[0] if len(names) == 1 else ", ".join(names[:-1]) + " and " + names[-1]
