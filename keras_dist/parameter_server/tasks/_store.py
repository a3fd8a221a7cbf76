"""The parameter server's side: a store of variables (and optimizer slots) by key.

Each ps task holds the variables placed on it as NumPy arrays. Every request
is atomic: the writes of one ``update`` (one worker's step for this ps task)
are applied under the store's lock, and the values it returns are read under
the same lock, so N workers × K steps that each add to a counter leave it at
exactly N·K and a reader never sees half a step. Optimizer updates run here
too (``_loaded_update.LoadedUpdate``), on the current values, one after the other.
Additive writes (``add``, ``sub``: ``assign_add``, metric totals) compose
across workers; ``assign`` is last-writer-wins, as on TF's parameter servers.

>>> import numpy as np
>>> store = VariableStore("/job:ps/replica:0/task:0")
>>> _ = store.handle({"op": "create", "keys": ["v"]}, [np.zeros(2)], b"")
>>> reply = store.handle(
...     {"op": "update", "writes": [["v", "add"]], "read": ["v"]}, [np.ones(2)], b"")
>>> _wire.decode(reply)[1][0].tolist()
[1.0, 1.0]
"""

import collections
import threading

import numpy as np

from keras_dist import errors
from keras_dist.parameter_server.rpc import _protocol as protocol
from keras_dist.parameter_server.rpc import _wire
from keras_dist.parameter_server.tasks._loaded_update import LoadedUpdate

# A call is run again within seconds of its worker's loss, and a request is sent
# again within RECONNECT_SECONDS (30 s) of a lost connection, while the other
# requests go on: this many of the latest ids are plenty, and bound memory.
_REMEMBERED_RUNS = 1 << 16


class VariableStore:
    """The variables of one ps task; ``handle`` answers the transport's requests."""

    def __init__(self, task_name: str):
        self.task_name = task_name
        self._values: dict = {}
        self._updates: dict = {}  # update id -> LoadedUpdate
        self._lock = threading.Lock()
        # The run ids of the last requests applied: a call that is run again (its
        # worker was lost after this task applied its step) is not applied twice.
        self._applied_runs: collections.OrderedDict = collections.OrderedDict()
        self.version = 0  # bumped by every write; lets readers skip unchanged values

    def keys(self) -> list:
        """The keys of the variables this task holds (one per variable or shard)."""
        with self._lock:
            return sorted(self._values)

    def handle(self, header: dict, arrays: list, blob: bytes):
        """Answers one request: ``(header, arrays, blob)``, or an encoded reply (reads)."""
        op = protocol.check_request(header, "ps")
        if op is protocol.PING:
            return {"task": self.task_name}, [], b""
        if op is protocol.CREATE:
            return self._create(header["keys"], arrays, header.get("if_absent", False))
        if op is protocol.READ:
            return self._read(header["keys"])
        if op is protocol.UPDATE:
            return self._update(header, arrays)
        if op is protocol.LOAD_UPDATE:
            update = LoadedUpdate(header, blob)
            with self._lock:
                self._updates.setdefault(header["update_id"], update)
            return {}, [], b""
        if op is protocol.DELETE:
            self._delete(set(header["keys"]))
            return {}, [], b""
        raise AssertionError(f"`{op.name}` is in the protocol and not served here")

    def _delete(self, keys: set) -> None:
        """Forgets ``keys`` and the optimizer updates that use any of them.

        An update's program (compiled here, a few MiB) is of no use once a
        variable it reads is gone: keys are never reused, so nothing runs it again.
        """
        with self._lock:
            for key in keys:
                self._values.pop(key, None)
            self._updates = {
                update_id: update
                for update_id, update in self._updates.items()
                if keys.isdisjoint(update.held)
            }

    def _create(self, keys, arrays, if_absent):
        created = []
        with self._lock:
            for key, value in zip(keys, arrays):
                if if_absent and key in self._values:
                    continue
                self._values[key] = np.array(value, copy=True)
                created.append(key)
            self.version += 1
            current = [self._values[key] for key in keys]
            return {"created": created, "version": self.version}, current, b""

    def _lookup(self, key):
        try:
            return self._values[key]
        except KeyError:
            raise errors.NotFoundError(
                f"{self.task_name} holds no variable {key!r}: the task restarted and lost "
                "its variables, or the variable was never created. Restart training from "
                f"a checkpoint. Received: key={key!r}",
                (self.task_name,),
            ) from None

    def _read(self, keys):
        with self._lock:
            values = [self._lookup(key) for key in keys]
            version = self.version
        return _wire.encode({"version": version}, values)  # a snapshot, as in ``_update``

    def _update(self, header, arrays):
        writes = header["writes"]
        updates_header = header.get("updates", ())
        expected = len(writes) + sum(count for _, count in updates_header)
        if len(arrays) != expected:
            raise errors.InvalidArgumentError(
                f"An `update` request to {self.task_name} carries {len(arrays)} arrays for "
                f"{len(writes)} writes and optimizer updates of {expected - len(writes)} "
                f"arrays. Received: {len(arrays)} arrays"
            )
        run_id = header.get("run_id")
        with self._lock:
            if run_id is not None and run_id in self._applied_runs:
                values = [self._lookup(key) for key in header.get("read", ())]
                return _wire.encode({"version": self.version, "repeated": True}, values)
            # A request is applied whole or not at all: every new value is computed
            # into ``staged`` first (a write that cannot be applied raises there), and
            # the store changes only once all of them are.
            for (key, _), value in zip(writes, arrays):
                _check_write(self.task_name, key, self._lookup(key), value)
            updates = [(self._loaded_update(u), count) for u, count in updates_header]
            staged: dict = {}

            def current(key):
                return staged[key] if key in staged else self._lookup(key)

            # Optimizer updates first: they read the iteration count before
            # this step's increment, as Keras's ``apply`` does.
            position = len(writes)
            for update, count in updates:
                held = [current(key) for key in update.held]
                for key, value in update.run(held, arrays[position : position + count]):
                    staged[key] = value
                position += count
            for (key, kind), value in zip(writes, arrays):
                target = current(key)  # as the updates left it
                # New arrays, not in place: an optimizer update's results are
                # read-only JAX arrays, and ``value`` is a view of the request.
                if kind == "assign":
                    staged[key] = np.array(value, dtype=target.dtype)
                else:
                    combine = np.add if kind == "add" else np.subtract
                    staged[key] = combine(target, value).astype(target.dtype, copy=False)
            self._values.update(staged)
            if run_id is not None:
                self._applied_runs[run_id] = None
                if len(self._applied_runs) > _REMEMBERED_RUNS:
                    self._applied_runs.popitem(last=False)
            self.version += 1
            version = self.version
            values = [self._lookup(key) for key in header.get("read", ())]
        # Stored values are replaced, never changed in place: the arrays taken
        # under the lock are a consistent snapshot, encoded without holding it.
        return _wire.encode({"version": version}, values)

    def _loaded_update(self, update_id) -> LoadedUpdate:
        update = self._updates.get(update_id)
        if update is None:
            raise errors.NotFoundError(
                f"{self.task_name} has no optimizer update {update_id!r}: the task restarted "
                "and lost it. Restart training from a checkpoint. "
                f"Received: update_id={update_id!r}",
                (self.task_name,),
            )
        for key in update.held:
            self._lookup(key)
        return update


def _check_write(task_name: str, key: str, target, value) -> None:
    """Raises ``InvalidArgumentError`` unless ``value`` can be written to ``target``."""
    if value.shape != target.shape:
        raise errors.InvalidArgumentError(
            f"A write to {key!r} on {task_name} has the wrong shape. "
            f"Received: shape {value.shape}, variable shape {target.shape}"
        )
    if value.dtype == target.dtype:
        return
    try:  # float64 into float32 is fine (same kind); a string or complex into floats is not
        castable = value.dtype != object and np.can_cast(value.dtype, target.dtype, "same_kind")
    except TypeError:
        castable = False
    if not castable:
        raise errors.InvalidArgumentError(
            f"A write to {key!r} on {task_name} has a dtype the variable cannot take. "
            f"Received: dtype {value.dtype}, variable dtype {target.dtype}"
        )
