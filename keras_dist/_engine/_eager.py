"""The eager engine: one thread per local replica, run in turn, as TF's MirroredStrategy.

Used when ``keras_dist.config.run_functions_eagerly(True)`` is set (to
``print`` and debug with real values), and automatically when per-replica
inputs have different shapes (the last partial batch of a custom loop), which
one compiled program cannot take.

Replica threads run one at a time, in replica order, each on its own device
(``jax.default_device``) until it finishes or reaches a ``merge_call``: so a
layer built by replica 0 is reused by the others, and the run is deterministic.
When every replica has reached the ``merge_call``, the calling thread runs
``merge_fn`` once in the cross-replica context with the replicas' arguments
regrouped into ``PerReplica`` values; each replica resumes with its own part of
the result. ``all_reduce`` and ``all_gather`` are ``merge_call`` s, as in TF.
"""

import threading

import jax
import jax.numpy as jnp

from keras_dist import _context
from keras_dist._engine._tf_summaries import adopt_summary_state
from keras_dist._engine._tf_summaries import caller_summary_state
from keras_dist._engine_contract import ReplicaEngine
from keras_dist._keras import KerasVariable
from keras_dist._replica_context import ReplicaContext
from keras_dist._values import DistributedValues
from keras_dist._values import regroup

_ABORT = object()


class _ReplicaAborted(BaseException):
    """Stops the other replicas after one of them failed."""


class _ReplicaThread(threading.Thread):
    def __init__(self, engine, index, device, fn, args, kwargs, created):
        super().__init__(name=f"keras_dist-replica-{index}", daemon=True)
        self.created = created  # variables each replica made in this run
        self.engine = engine
        self.index = index
        self.device = device
        self.fn, self.args, self.kwargs = fn, args, kwargs
        self.should_run = threading.Event()
        self.has_paused = threading.Event()
        self.done = False
        self.result = None
        self.error = None
        self.merge_request = None
        self.merge_result = None
        # Made in the caller's thread: replica 0 writes its tf.summary calls there.
        records = engine.replica_id(index) == 0
        self.summary_state = caller_summary_state() if records else None

    def run(self):
        self.should_run.wait()
        self.should_run.clear()
        if self.merge_result is _ABORT:  # another replica failed before this one started
            self.done = True
            self.has_paused.set()
            return
        strategy = self.engine.strategy
        replica = self.engine.replica_engine(self)
        replica_id = self.engine.replica_id(self.index)
        context = ReplicaContext(strategy, replica_id, _engine=replica, _eager_index=self.index)
        try:
            adopt_summary_state(self.summary_state)
            with _context.push(_context.Frame(strategy, context, engine=replica)):
                with self.engine.thread_context(self):
                    self.result = self.fn(*self.args, **self.kwargs)
        except _ReplicaAborted:
            pass
        except BaseException as error:  # re-raised unchanged in the caller
            self.error = error
        finally:
            self.done = True
            self.has_paused.set()

    def merge(self, merge_fn, args, kwargs):
        self.merge_request = (merge_fn, args, kwargs)
        self.has_paused.set()
        self.should_run.wait()
        self.should_run.clear()
        result, self.merge_result = self.merge_result, None
        if result is _ABORT:
            raise _ReplicaAborted()
        return result


class EagerReplica(ReplicaEngine):
    compiled = False

    def __init__(self, thread):
        self._thread = thread

    def primary_for(self, variable):
        """Replica 0's counterpart of a variable another replica creates, if any.

        Each replica thread runs the function, so a variable created inside it is
        created once per replica; as TF's MirroredStrategy does, the k-th
        variable a replica creates is replica 0's k-th (see ``_keras._variables``).
        """
        thread = self._thread
        mine = thread.created[thread.index]
        mine.append(variable)
        if thread.index == 0 or len(mine) > len(thread.created[0]):
            return None
        return thread.created[0][len(mine) - 1]

    def merge_call(self, replica_context, merge_fn, args, kwargs):
        return self._thread.merge(merge_fn, args, kwargs)

    def refuse_traced(self, leaves, name) -> None:
        """Values being differentiated cannot cross the replica threads."""
        _refuse_traced(leaves, name)

    def all_reduce(self, reduce_op, value):
        leaves, treedef = jax.tree_util.tree_flatten(value)
        # Each replica contributes its own tensors, as TF converts them first.
        leaves = [jnp.asarray(x) for x in leaves]
        self.refuse_traced(leaves, "all_reduce")

        def merge_fn(strategy, *values):
            return strategy.extended.batch_reduce_to(reduce_op, [(v, v) for v in values])

        reduced = self._thread.merge(merge_fn, leaves, {})
        return jax.tree_util.tree_unflatten(treedef, list(reduced))

    def all_gather(self, value, axis):
        leaves, treedef = jax.tree_util.tree_flatten(value)
        leaves = [jnp.asarray(x) for x in leaves]
        self.refuse_traced(leaves, "all_gather")

        def merge_fn(strategy, *values):
            return [self.gather_in_merge(strategy, v, axis) for v in values]

        gathered = self._thread.merge(merge_fn, leaves, {})
        return jax.tree_util.tree_unflatten(treedef, list(gathered))

    def gather_in_merge(self, strategy, value, axis):
        """The merge side of ``all_gather``: every replica's ``value`` for every replica."""
        gathered = strategy.gather(value, axis)
        return strategy.extended.broadcast_to(gathered, None)


def _refuse_traced(leaves, name):
    if any(isinstance(x, jax.core.Tracer) for x in leaves):
        raise RuntimeError(
            f"`{name}` was called on values being differentiated or traced on an eager "
            "replica: JAX cannot follow a gradient across the eager engine's replica "
            "threads. The compiled engine supports it, and is used whenever every "
            "replica's inputs have the same shape: avoid `run_functions_eagerly(True)` "
            "here, and make the dataset size a multiple of the global batch size. "
            f"Received: {len(leaves)} traced value(s)."
        )


class EagerEngine:
    """Runs a replica function on one thread per local replica."""

    def __init__(self, extended):
        self._extended = extended

    @property
    def strategy(self):
        return self._extended.container_strategy

    def update_components(self, variable, fn, args, kwargs):
        """``extended.update`` of a SyncOnRead variable with per-replica arguments.

        Applies ``fn`` to each replica's component with that replica's arguments.
        """
        strategy = self.strategy
        results = []
        for index, device in enumerate(self._extended.local_devices):
            replica_id = self._extended.first_local_replica_id + index
            context = ReplicaContext(strategy, replica_id, _eager_index=index)
            local_args, local_kwargs = select_replica_part(index, device, (args, kwargs))
            with _context.push(_context.Frame(strategy, context)):
                results.append(fn(variable, *local_args, **local_kwargs))
        return regroup(results)

    def run(self, fn, args, kwargs):
        extended = self._extended
        per_replica = [
            select_replica_part(index, device, (args, kwargs))
            for index, device in enumerate(extended.local_devices)
        ]
        results = self.run_threads(fn, per_replica)
        if len(results) == 1:
            return results[0]
        return regroup(results)

    def run_threads(self, fn, per_replica) -> list:
        """Runs ``fn`` on one thread per ``(args, kwargs)`` of ``per_replica``; their results."""
        strategy = self._extended.container_strategy
        threads = []
        devices = self.thread_devices()
        created = [[] for _ in devices]
        for index, device in enumerate(devices):
            local_args, local_kwargs = per_replica[index]
            threads.append(
                _ReplicaThread(self, index, device, fn, local_args, local_kwargs, created)
            )
        for thread in threads:
            thread.start()
        try:
            self._drive(strategy, threads)
        finally:
            for thread in threads:
                if not thread.done:
                    thread.merge_result = _ABORT
                    thread.should_run.set()
            for thread in threads:
                thread.join()
        for thread in threads:
            if thread.error is not None:
                raise thread.error
        return [thread.result for thread in threads]

    # What a subclass may change: which replicas run, how a replica thread runs
    # and how a merge sees the replicas' values.
    def thread_devices(self) -> list:
        """One device per replica thread: this process's replicas'."""
        return list(self._extended.local_devices)

    def replica_id(self, index: int) -> int:
        """The ``replica_id_in_sync_group`` of replica thread ``index``."""
        return self._extended.first_local_replica_id + index

    def replica_engine(self, thread) -> ReplicaEngine:
        """The ``ReplicaEngine`` a replica thread's context talks to."""
        return EagerReplica(thread)

    def thread_context(self, thread):
        """The context a replica thread runs ``fn`` in: its own device."""
        return jax.default_device(thread.device)

    def group_for_merge(self, per_replica_values: list):
        """The replicas' ``merge_call`` arguments, regrouped into distributed values."""
        return regroup(per_replica_values)

    def merge_frame(self, strategy):
        """The cross-replica context frame a ``merge_fn`` runs in."""
        return _context.Frame(strategy, None)

    def select_for_replica(self, index, device, result):
        """Replica ``index``'s part of a ``merge_fn`` result."""
        return select_replica_part(index, device, result)

    def _drive(self, strategy, threads):
        while True:
            for thread in threads:
                if not thread.done:
                    thread.should_run.set()
                    thread.has_paused.wait()
                    thread.has_paused.clear()
                    if thread.error is not None:
                        return
            waiting = [t for t in threads if not t.done]
            if not waiting:
                return
            if len(waiting) != len(threads):
                raise RuntimeError(
                    "Some replicas called `merge_call` (or a collective) while others "
                    "had finished: every replica must make the same collective calls. "
                    f"Received: replicas {[t.index for t in waiting]} waiting in "
                    "merge_call."
                )
            self._merge(strategy, threads)

    def _merge(self, strategy, threads):
        merge_fn = threads[0].merge_request[0]
        grouped_args = self.group_for_merge([t.merge_request[1] for t in threads])
        grouped_kwargs = self.group_for_merge([t.merge_request[2] for t in threads])
        for thread in threads:
            thread.merge_request = None
        with _context.push(self.merge_frame(strategy)):
            result = merge_fn(strategy, *grouped_args, **grouped_kwargs)
        for thread in threads:
            thread.merge_result = self.select_for_replica(thread.index, thread.device, result)


def select_replica_part(index, device, structure):
    """Replica ``index``'s part of ``structure``: its components, on ``device``."""

    def pick(x):
        if isinstance(x, DistributedValues):
            return x.values[index]
        if isinstance(x, jax.core.Tracer):
            return x
        if isinstance(x, jax.Array) and len(x.sharding.device_set) > 1:
            if x.is_fully_replicated:
                return x.addressable_data(0) if device is None else on_device(x, device)
        elif isinstance(x, jax.Array) and device is not None and x.is_fully_addressable:
            # One device's array (a `strategy.reduce` result): copied to the replica's
            # device, as TF copies it, so the replica's ops can mix it with its values.
            if x.sharding.device_set != {device}:
                return jax.device_put(x, device)
        return x

    return jax.tree_util.tree_map(pick, structure, is_leaf=_is_leaf)


def on_device(array, device):
    """The copy of a replicated global ``array`` on ``device`` (no transfer when present)."""
    for shard in array.addressable_shards:
        if shard.device == device:
            return shard.data
    return jax.device_put(array.addressable_data(0), device)


def _is_leaf(x):
    return isinstance(x, (DistributedValues, KerasVariable))
