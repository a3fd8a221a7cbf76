"""The client side of the parameter servers: where variables live and how to reach them.

A variable's ``Location`` is its shards: ``(ps task, key, rows)`` each, rows
along axis 0 (one shard holding every row for an unpartitioned variable).
``ParameterServers`` reads and writes many variables with one request per ps
task, sent to the tasks in parallel: a step costs one round trip per ps task.

>>> loc = Location((Shard(0, "v0", 3), Shard(1, "v1", 2)), (5, 2), "float32")
>>> loc.tasks
(0, 1)
"""

import concurrent.futures
import logging
import queue
import threading
import time
import uuid
from typing import NamedTuple

import numpy as np

from keras_dist import errors
from keras_dist.parameter_server.rpc import _protocol as protocol
from keras_dist.parameter_server.rpc._transport import DEFAULT_TIMEOUT
from keras_dist.parameter_server.rpc._transport import RECONNECT_SECONDS
from keras_dist.parameter_server.rpc._transport import RpcClient
from keras_dist.parameter_server.rpc._wire import dtype_from_name

logger = logging.getLogger("keras_dist.ps")
_WAIT_NOTE_EVERY = 15.0  # seconds between the notes of a wait for the ps tasks


def ps_device(task: int) -> str:
    """The TF device name of ps task ``task``."""
    return f"/job:ps/replica:0/task:{task}/device:CPU:0"


class Shard(NamedTuple):
    """One piece of a variable: the ps task holding it, its key there, its rows."""

    task: int
    key: str
    rows: int


class Location(NamedTuple):
    """Where a variable's value lives: its shards in row order, its shape and dtype."""

    shards: tuple
    shape: tuple
    dtype: str

    @property
    def tasks(self) -> tuple:
        return tuple(shard.task for shard in self.shards)

    def split(self, value) -> list:
        """``value`` cut into this location's shards (along axis 0)."""
        if len(self.shards) == 1:
            return [value]
        bounds = np.cumsum([shard.rows for shard in self.shards])[:-1]
        return np.split(value, bounds, axis=0)

    def join(self, pieces):
        """The whole value from its shards' values."""
        if len(pieces) == 1:
            return pieces[0]
        return np.concatenate(pieces, axis=0)

    def as_json(self) -> list:
        return [[list(s) for s in self.shards], list(self.shape), self.dtype]

    @classmethod
    def from_json(cls, data) -> "Location":
        shards, shape, dtype = data
        return cls(tuple(Shard(*s) for s in shards), tuple(shape), dtype)


class ParameterServers:
    """Clients of every ps task of a cluster spec (``kd.cluster_resolver.ClusterSpec``).

    A call whose connection to a ps task was lost is sent again until the task
    answers, for up to ``retry_seconds`` (``RECONNECT_SECONDS``: a link down for
    a few seconds costs nothing); then it raises ``UnavailableError`` naming the
    task. Every request may so reach a task twice, and is applied once: reads,
    ``create``, ``load_update`` and ``delete`` are the same done twice, and each
    ``update`` carries an id (its call's ``run_id``, or one of its own) that the
    task answers a second time from, without applying it again.
    """

    def __init__(
        self,
        cluster_spec,
        credentials=None,
        timeout: float = DEFAULT_TIMEOUT,
        retry_seconds: float = RECONNECT_SECONDS,
    ):
        addresses = cluster_spec.job_tasks("ps") if "ps" in cluster_spec.jobs else []
        self.clients = [
            RpcClient(
                address,
                name=f"/job:ps/replica:0/task:{i}",
                credentials=credentials,
                retry_seconds=retry_seconds,
            )
            for i, address in enumerate(addresses)
        ]
        self.timeout = timeout
        self._to_delete: queue.SimpleQueue = queue.SimpleQueue()
        self._freeing = None
        self._freeing_lock = threading.Lock()
        self._pool = concurrent.futures.ThreadPoolExecutor(
            max(1, len(self.clients)), thread_name_prefix="kd-ps-client"
        )

    @property
    def num_ps(self) -> int:
        return len(self.clients)

    def _each_task(self, requests: dict) -> dict:
        """Sends ``{task: (header, arrays)}`` in parallel; ``{task: (header, arrays)}`` back."""
        if len(requests) == 1:
            (task, (header, arrays)), *_ = requests.items()
            reply = self.clients[task].call(header, arrays, timeout=self.timeout)
            return {task: reply[:2]}
        futures = {
            task: self._pool.submit(self.clients[task].call, h, a, timeout=self.timeout)
            for task, (h, a) in requests.items()
        }
        return {task: future.result()[:2] for task, future in futures.items()}

    def wait_until_ready(self, timeout: float) -> None:
        """Returns once every ps task answers (tasks start in any order), or raises."""
        start = time.monotonic()
        deadline, next_note = start + timeout, start + _WAIT_NOTE_EVERY
        for task in range(self.num_ps):
            while True:
                try:
                    # Not retried within: this loop tries again, up to its own deadline.
                    left = deadline - time.monotonic()
                    self.ping(task, timeout=max(1.0, min(5.0, left)), retry=False)
                    break
                except errors.UnavailableError:
                    now = time.monotonic()
                    if now >= deadline:
                        raise
                    if now >= next_note:  # (a ps that never starts is not a silent wait)
                        logger.warning(
                            "Waiting for ps task %d at %s: not answering after %.0f s "
                            "(giving up after %.0f s).",
                            task,
                            self.clients[task].address,
                            now - start,
                            timeout,
                        )
                        next_note = now + _WAIT_NOTE_EVERY
                    time.sleep(0.2)

    def ping(self, task: int, timeout: float = 5.0, retry: bool = True) -> None:
        """Raises ``UnavailableError`` when ps task ``task`` does not answer.

        With ``retry``, a lost connection is first waited out (``retry_seconds``).
        """
        self.clients[task].call(protocol.request(protocol.PING), timeout=timeout, retry=retry)

    def create(self, location: Location, value, if_absent: bool = False):
        """Stores ``value``'s shards; with ``if_absent``, keeps values already there.

        Returns the value now stored (another worker's, if it created it first).
        """
        requests = {}
        for shard, piece in zip(location.shards, location.split(np.asarray(value))):
            header, arrays = requests.setdefault(
                shard.task, (protocol.request(protocol.CREATE, keys=[], if_absent=if_absent), [])
            )
            header["keys"].append(shard.key)
            arrays.append(piece)
        replies = self._each_task(requests)
        return self._gather([location], replies)[0]

    def read(self, locations) -> list:
        """The values of ``locations``, one request per ps task."""
        requests = {}
        for location in locations:
            for shard in location.shards:
                header, _ = requests.setdefault(
                    shard.task, (protocol.request(protocol.READ, keys=[]), [])
                )
                header["keys"].append(shard.key)
        return self._gather(locations, self._each_task(requests))

    def update(self, writes, read=(), updates=(), run_id=None, versions=None) -> list:
        """Applies ``writes`` (``(location, kind, value)``: kind ``assign``/``add``/``sub``).

        ``updates`` are optimizer updates run on the ps tasks: ``(task, update
        id, arrays)``, after the writes. One atomic request per ps task; the
        values of ``read`` (locations) come back in the same requests. With
        ``run_id`` each ps task applies the request only if it has not applied
        one with that id before; without, the request gets an id of its own (a
        request sent again after a lost connection is applied once). A
        ``versions`` dict gets each ps task's version after the request (the
        version the values read are from).
        """
        requests: dict = {}
        once = {"run_id": run_id if run_id is not None else f"update-{uuid.uuid4().hex}"}

        def request(task):
            return requests.setdefault(
                task,
                (protocol.request(protocol.UPDATE, writes=[], read=[], updates=[], **once), []),
            )

        for location, kind, value in writes:
            for shard, piece in zip(location.shards, location.split(np.asarray(value))):
                header, arrays = request(shard.task)
                header["writes"].append([shard.key, kind])
                arrays.append(piece)
        for task, update_id, values in updates:
            header, arrays = request(task)
            header["updates"].append([update_id, len(values)])
            arrays.extend(values)
        for location in read:
            for shard in location.shards:
                request(shard.task)[0]["read"].append(shard.key)
        replies = self._each_task(requests)
        if versions is not None:
            versions.update((task, header["version"]) for task, (header, _) in replies.items())
        return self._gather(read, replies)

    def load_update(self, update) -> None:
        """Sends an optimizer's ``UpdateProgram`` to the ps task that runs it."""
        self.clients[update.task].call(update.header(), (), update.blob, timeout=self.timeout)

    @staticmethod
    def _gather(locations, replies) -> list:
        """Whole values of ``locations`` from replies listing their shards in request order."""
        position = dict.fromkeys(replies, 0)
        values = []
        for location in locations:
            pieces = []
            for shard in location.shards:
                pieces.append(replies[shard.task][1][position[shard.task]])
                position[shard.task] += 1
            value = location.join(pieces)
            values.append(value.astype(dtype_from_name(location.dtype), copy=False))
        return values

    def delete_soon(self, location: Location) -> None:
        """Frees a variable's shards in the background (a variable was collected).

        Called from a ``weakref.finalize`` callback, which may run inside any
        code that allocates, holding any lock: it only puts the location in a
        queue (no lock taken) for the thread ``start_freeing`` started.
        """
        self._to_delete.put(location)

    def start_freeing(self) -> None:
        """Starts the thread that frees collected variables (once)."""
        with self._freeing_lock:
            if self._freeing is None:
                self._freeing = threading.Thread(
                    target=self._free_loop, name="kd-ps-free", daemon=True
                )
                self._freeing.start()

    def _free_loop(self) -> None:
        while True:
            location = self._to_delete.get()
            # None: the clients are closed. Once the main thread has ended, the
            # interpreter is exiting and in-process servers accept no requests.
            if location is None or not threading.main_thread().is_alive():
                return
            self.delete(location)

    def delete(self, location: Location) -> None:
        """Frees a variable's shards (best effort: a lost task has lost them anyway)."""
        for shard in location.shards:
            try:
                request = protocol.request(protocol.DELETE, keys=[shard.key])
                self.clients[shard.task].call(request, timeout=5)
            except Exception:  # noqa: BLE001 - freeing memory on a dead task is moot
                pass

    def close(self) -> None:
        self._to_delete.put(None)
        for client in self.clients:
            client.close()
        self._pool.shutdown(wait=False)
