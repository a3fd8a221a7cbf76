"""``PSVariable``: a Keras variable whose value lives on the parameter servers.

The strategy's variable policy gives a variable created in its scope this
class and a ``Location`` (its ps task, or its shards on several). Keras reads
and writes a variable's value through ``_value``; here that attribute reads
from and writes to the ps tasks, so every Keras code path (``numpy()``,
``assign``, saving) works unchanged on the coordinator. Inside a scheduled
function's trace the value is a traced input instead (the engine's stateless
scope maps it), and writes are recorded with their kind: an ``assign_add`` is
sent as a delta that the ps adds atomically, so concurrent workers compose.
"""

import threading
import weakref

import jax.numpy as jnp
import numpy as np

from keras_dist._keras import KerasVariable
from keras_dist._keras import RecordingScope
from keras_dist._keras import current_scope
from keras_dist._thread_state import set_for_block
from keras_dist._values._variables import DistributedVariable
from keras_dist.parameter_server.variables._client import ps_device
from keras_dist.parameter_server.variables._sharded import ShardedVariable
from keras_dist.parameter_server.variables._sharded import lookup_rows
from keras_dist.parameter_server.variables._trace import current_trace


class _ShardShapes(threading.local):
    def __init__(self):
        self.shapes: dict = {}  # id(variable) -> the shape this thread sees


_shard_shapes = _ShardShapes()


def shard_shapes(shapes: dict):
    """On this thread only, variables ``id -> shape`` have a shard's shape (tracing its update)."""
    return set_for_block(_shard_shapes, "shapes", {**_shard_shapes.shapes, **shapes})


class PSVariable(DistributedVariable):
    """A variable stored on parameter-server tasks (``ParameterServerStrategy``).

    ``device`` names the ps task holding it; a partitioned variable's
    ``variables`` are its shards.
    """

    @property
    def shape(self):
        return _shard_shapes.shapes.get(id(self)) or KerasVariable.shape.fget(self)

    def bind(self, location, servers, *, if_absent: bool = False) -> None:
        """Gives the variable its place on the ps tasks (the strategy's policy calls this)."""
        self.__dict__["_kd_location"] = location
        self.__dict__["_kd_servers"] = servers
        self.__dict__["_kd_if_absent"] = if_absent
        self.__dict__["_kd_created"] = False
        if not if_absent:
            # The ps tasks free the value once nothing here holds the variable.
            # (Between-graph workers share their variables: none frees them.)
            servers.start_freeing()
            free = weakref.finalize(self, servers.delete_soon, location)
            free.atexit = False

    @property
    def location(self):
        """The ``Location`` of the variable's shards."""
        return self.__dict__.get("_kd_location")

    @property
    def servers(self):
        """The client of the ps tasks (``ParameterServers``) the variable is stored through."""
        return self.__dict__["_kd_servers"]

    @property
    def stored_on_servers(self) -> bool:
        """Whether the ps tasks hold the variable's value (its first value was sent)."""
        return bool(self.__dict__.get("_kd_created"))

    @property
    def device(self) -> str:
        """The device of the ps task holding the variable (its first shard's, if sharded)."""
        return ps_device(self.location.shards[0].task)

    @property
    def variables(self) -> list:
        """The variable's shards (one ``VariableShard`` each), in row order."""
        return [VariableShard(self, i) for i in range(len(self.location.shards))]

    def numpy(self):
        """The value as a NumPy array (read from the ps tasks)."""
        return np.asarray(self.value)

    @property
    def _value(self):
        location = self.location
        if location is None or not self.__dict__.get("_kd_created"):
            return self.__dict__.get("_kd_initial")
        self._distribute_strategy.extended.settle()
        return jnp.asarray(self.__dict__["_kd_servers"].read([location])[0])

    @_value.setter
    def _value(self, value):
        location = self.location
        if value is None:
            return
        if location is None:
            self.__dict__["_kd_initial"] = value
            return
        servers = self.__dict__["_kd_servers"]
        value = np.asarray(value)
        self._distribute_strategy.extended.new_consistency_epoch()
        if not self.__dict__.get("_kd_created"):
            servers.create(location, value, if_absent=self.__dict__.get("_kd_if_absent"))
            self.__dict__["_kd_created"] = True
        else:
            servers.update([(location, "assign", value)])

    def assign(self, value):
        return self._write("assign", value)

    def assign_add(self, value):
        return self._write("add", value)

    def assign_sub(self, value):
        return self._write("sub", value)

    def _write(self, kind, value):
        scope = current_scope()
        if isinstance(scope, RecordingScope) and scope.deferred_writes is not None:
            # Inside ``value_and_grad``: replayed with its kind after the gradient,
            # so an ``assign_add`` still reaches the ps as a delta.
            method = {"add": "assign_add", "sub": "assign_sub"}.get(kind, "assign")
            scope.deferred_writes.append((self, method, value))
            return value
        if scope is not None:
            # Traced (a scheduled function) or inside Keras's stateless code:
            # the scope records the new value; the trace, how it was made.
            trace = current_trace()
            if trace is not None:
                trace.note_write(self, "assign" if kind == "assign" else "add")
            if kind == "add":
                value = self.value + value
            elif kind == "sub":
                value = self.value - value
            return KerasVariable.assign(self, value)
        value = self._convert_to_tensor(value, dtype=self.dtype)
        if kind == "assign":
            return KerasVariable.assign(self, value)
        # Coordinator side: the ps applies the delta atomically.
        delta = np.broadcast_to(np.asarray(value), self.shape)
        self._distribute_strategy.extended.new_consistency_epoch()
        self.__dict__["_kd_servers"].update([(self.location, kind, delta)])
        return value


class PartitionedVariable(PSVariable):
    """A ``PSVariable`` split into row shards on several ps tasks (a ``ShardedVariable``)."""

    def embedding_lookup(self, ids):
        """Rows ``ids`` of the whole variable (``tf.nn.embedding_lookup``)."""
        return lookup_rows(self.value, ids)


ShardedVariable.register(PartitionedVariable)


class VariableShard:
    """One shard of a partitioned ``PSVariable``: its rows on one ps task.

    Reads go to that task alone; ``assign`` replaces the shard's rows.
    """

    def __init__(self, variable: PSVariable, index: int):
        self._variable = variable
        self._index = index

    @property
    def _shard(self):
        return self._variable.location.shards[self._index]

    @property
    def device(self) -> str:
        return ps_device(self._shard.task)

    @property
    def shape(self) -> tuple:
        return (self._shard.rows, *self._variable.shape[1:])

    @property
    def dtype(self):
        return self._variable.dtype

    def _single(self):
        location = self._variable.location
        return type(location)((self._shard,), self.shape, location.dtype)

    def numpy(self):
        return self._variable.servers.read([self._single()])[0]

    def __array__(self, dtype=None, copy=None):
        value = self.numpy()
        return value if dtype is None else value.astype(dtype)

    def assign(self, value):
        servers = self._variable.servers
        self._variable.distribute_strategy.extended.new_consistency_epoch()
        servers.update([(self._single(), "assign", np.asarray(value))])
        return self

    def __repr__(self):
        return f"<VariableShard {self._index} of {self._variable.path} on {self.device}>"
