"""Which peers of a multi-process job are still there, asked directly: a line service per process.

When a collective fails, its survivors must name the task that was lost, and
only that one. JAX's coordination service cannot tell them: it runs inside
process 0 (gone when process 0 is the one lost, or when it left first after
its own error), and a healthy peer blocked in a collective that waits on
another survivor does not report in there until its own collective fails. So
each process also answers on a port of its own (a thread; one JSON line each
way) and the survivors ask every peer directly:

* ``{"ask": "here"}`` → ``{"here": process_id, "failed": bool}``: a dead task
  refuses or resets the connection, a frozen one (SIGSTOP) or a host whose link
  is cut does not answer in time, and a healthy one answers even while its main
  thread waits in a collective (that wait releases the GIL). ``failed``: it has
  found the collective broken too (a task alive but stuck outside the
  collective never does).
* ``{"ask": "lost", "from": i, "lost": [j, ...], "timed_out": bool}``: news from
  a survivor that found tasks ``j`` lost (or stuck, ``timed_out``). A peer
  still waiting in a collective that will never end (its own neighbours alive
  but failed) learns of the loss at once instead of at its deadline, and a
  survivor that has left since is known not to be lost.

Addresses are exchanged once, right after the roll call, through the
coordination service's key-value store, and kept here.

>>> a, b = Presence(0, "127.0.0.1"), Presence(1, "127.0.0.1")
>>> a.peers = b.peers = {0: a.address, 1: b.address}
>>> a.survey([1])
{1: False}
>>> a.tell_lost([1], [7], timed_out=False); b.news.wait(5)
True
>>> b.lost_news(), b.news_senders(), b.news_timed_out()
([7], [0], False)
>>> a.close(); b.close()
"""

import json
import socket
import threading

_KEY_PREFIX = "keras_dist/presence/"
# How long a peer has to answer "here": a healthy one answers in milliseconds,
# even on a loaded machine within a second or two.
ANSWER_SECONDS = 2.0
# A message is a few dozen bytes; a longer line is not ours and is cut off (then refused).
_LINE_LIMIT = 65536


class Presence:
    """This process's answering service, and the peers' addresses.

    Args:
        process_id: this process's id in the job.
        host: the address peers reach this process at (its address towards the
            coordinator; ``local_address`` finds it).
    """

    def __init__(self, process_id: int, host: str):
        self.process_id = process_id
        self._server = socket.create_server((host, 0))
        self.address = f"{host}:{self._server.getsockname()[1]}"
        self.peers: dict = {}  # process id -> "host:port"
        self.failed = False  # this process found the collective broken
        self.news = threading.Event()  # set once a survivor's news arrived
        self._news: dict = {}  # sender -> the process ids it found lost
        self._news_timed_out = False
        self._lock = threading.Lock()
        threading.Thread(target=self._serve, name="keras_dist-presence", daemon=True).start()

    def publish(self, client, num_processes: int, timeout_seconds: float) -> None:
        """Exchanges addresses with every peer through the coordination service."""
        client.key_value_set(f"{_KEY_PREFIX}{self.process_id}", self.address)
        for peer in range(num_processes):
            if peer != self.process_id:
                key = f"{_KEY_PREFIX}{peer}"
                self.peers[peer] = client.blocking_key_value_get(key, int(timeout_seconds * 1000))

    def survey(self, peers) -> dict:
        """Each of ``peers`` (process ids), asked at once: ``None`` when silent for
        ``ANSWER_SECONDS``, else whether it has found the collective broken too."""
        answers = dict.fromkeys(peers)

        def ask(peer):
            answer = _request(self.peers.get(peer), {"ask": "here"})
            if answer is not None and answer.get("here") == peer:
                answers[peer] = bool(answer.get("failed"))

        threads = [threading.Thread(target=ask, args=(p,), daemon=True) for p in peers]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(ANSWER_SECONDS + 1.0)
        return dict(answers)

    def tell_lost(self, peers, lost, timed_out: bool) -> None:
        """Tells ``peers`` that ``lost`` were found lost here (each asked at once, best effort)."""
        message = {"ask": "lost", "from": self.process_id, "lost": sorted(lost)}
        message["timed_out"] = timed_out
        threads = [
            threading.Thread(target=_request, args=(self.peers.get(p), message), daemon=True)
            for p in peers
        ]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(ANSWER_SECONDS + 1.0)

    def lost_news(self) -> list:
        """Every process id a survivor's news named lost."""
        with self._lock:
            return sorted({peer for lost in self._news.values() for peer in lost})

    def news_timed_out(self) -> bool:
        """Whether a survivor's news was of a task stuck (a deadline) rather than gone."""
        with self._lock:
            return self._news_timed_out

    def news_senders(self) -> list:
        """The survivors that sent news (alive then, whether or not they left since)."""
        with self._lock:
            return sorted(self._news)

    def close(self) -> None:
        self._server.close()

    def _serve(self):
        while True:
            try:
                connection, _ = self._server.accept()
            except OSError:  # closed
                return
            threading.Thread(
                target=self._answer, args=(connection,), name="keras_dist-presence", daemon=True
            ).start()

    def _answer(self, connection):
        with connection:
            try:
                connection.settimeout(ANSWER_SECONDS)
                message = json.loads(connection.makefile("r").readline(_LINE_LIMIT))
                if message.get("ask") == "lost":
                    with self._lock:
                        self._news[int(message["from"])] = [int(p) for p in message["lost"]]
                        self._news_timed_out |= bool(message.get("timed_out"))
                    self.news.set()
                    reply = {"ok": True}
                else:
                    reply = {"here": self.process_id, "failed": self.failed}
                connection.sendall((json.dumps(reply) + "\n").encode())
            except (OSError, ValueError, KeyError, TypeError):
                pass  # a broken or foreign request: nothing to answer


def _request(address, message) -> "dict | None":
    """One request and its answer; ``None`` when the peer refuses, resets or is silent."""
    if not address:
        return None
    host, port = address.rsplit(":", 1)
    try:
        with socket.create_connection((host, int(port)), timeout=ANSWER_SECONDS) as connection:
            connection.settimeout(ANSWER_SECONDS)
            connection.sendall((json.dumps(message) + "\n").encode())
            line = connection.makefile("r").readline(_LINE_LIMIT)
        return json.loads(line) if line else None
    except (OSError, ValueError):
        return None


def local_address(coordinator_address: str) -> str:
    """This host's address on the route to the coordinator (what its peers can reach).

    >>> local_address("127.0.0.1:1234")
    '127.0.0.1'
    """
    host, port = coordinator_address.rsplit(":", 1)
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect((host.strip("[]"), int(port)))  # UDP: sends nothing, picks the route
            return probe.getsockname()[0]
        except OSError:
            return "127.0.0.1"
