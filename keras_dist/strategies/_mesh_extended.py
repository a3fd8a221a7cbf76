"""The extended API of strategies whose replicas are the devices of one mesh.

``MirroredStrategy`` and ``OneDeviceStrategy`` share it. It owns the mesh, the
variable registry, the engines, and the cross-replica reductions.
"""

import weakref

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from keras_dist import _config
from keras_dist import _context
from keras_dist._cross_device_ops import AXIS
from keras_dist._cross_device_ops import CrossDeviceOps
from keras_dist._cross_device_ops import select_cross_device_ops
from keras_dist._devices import device_name
from keras_dist._devices import resolve_device
from keras_dist._engine._compiled import CompiledEngine
from keras_dist._engine._eager import EagerEngine
from keras_dist._engine._gate import GATE
from keras_dist._engine._gate import needs_serializing
from keras_dist._keras._hooks import StrategyDistribution
from keras_dist._keras._hooks import building_batch_norm
from keras_dist._keras._hooks import set_variable_class
from keras_dist._reduce_op import ReduceOp
from keras_dist._replica_context import ReplicaContext
from keras_dist.strategies._strategy import StrategyExtended
from keras_dist.strategies._strategy import require_cross_replica
from keras_dist._values._distributed_values import DistributedValues
from keras_dist._values._distributed_values import Mirrored
from keras_dist._values._distributed_values import PerReplica
from keras_dist._values._distributed_values import regroup
from keras_dist._values._variables import DistributedVariable
from keras_dist._values._variables import MirroredVariable
from keras_dist._values._variables import SyncOnReadVariable
from keras_dist.experimental._value_context import ValueContext


class _VariableState:
    """The variables a strategy created, split by kind, in creation order."""

    def __init__(self, version, mirrored, sync_on_read):
        self.version = version
        self.mirrored = mirrored
        self.sync_on_read = sync_on_read


class MeshExtended(StrategyExtended):
    """Extended API over a 1-D mesh of devices named ``"replica"``.

    ``devices`` are this process's replicas. ``mesh_devices``, when given, are
    every process's (multi-worker strategies): the mesh spans them, and values
    this process holds are its rows of global arrays.
    """

    # This process's place among the workers (input pipelines).
    _num_workers = 1
    _worker_index = 0

    def __init__(
        self,
        container_strategy,
        devices,
        cross_device_ops=None,
        parameter_device=None,
        mesh_devices=None,
    ):
        super().__init__(container_strategy)
        if cross_device_ops is not None and not isinstance(cross_device_ops, CrossDeviceOps):
            raise TypeError(
                "`cross_device_ops` must be a keras_dist.CrossDeviceOps such as "
                f"kd.NcclAllReduce(). Received: cross_device_ops={cross_device_ops!r}"
            )
        self._devices = tuple(devices)
        mesh_devices = tuple(mesh_devices or self._devices)
        self._multi_process = mesh_devices != self._devices
        # The global id of this process's first replica.
        self._replica_offset = mesh_devices.index(self._devices[0])
        self._mesh = Mesh(np.array(mesh_devices), (AXIS,))
        self._replicated = NamedSharding(self._mesh, P())
        self._split = NamedSharding(self._mesh, P(AXIS))
        # Where mirrored variables are stored: replicated on every replica's
        # device, or on one parameter device (central storage).
        self._parameter_device = parameter_device
        self._storage = (
            self._replicated
            if parameter_device is None
            # A named sharding (Keras's initializers ask for its mesh).
            else NamedSharding(Mesh(np.array([parameter_device]), (AXIS,)), P())
        )
        self._num_local_replicas = len(self._devices)
        self._num_replicas_in_sync = len(mesh_devices)
        self._serialize = needs_serializing(mesh_devices)
        # Variables whose first value is this process's own (multi-process):
        # replaced by worker 0's before anything reads them.
        self._unsynced: list = []
        self._cross_device_ops = cross_device_ops or select_cross_device_ops(self._devices)
        self._keras_distribution = StrategyDistribution(container_strategy)
        self._variable_refs: list = []
        self._variables_version = 0
        self._state_cache = None
        self._compiled = CompiledEngine(self)
        self._eager = EagerEngine(self)

    # ----------------------------------------------------------------- devices
    @property
    def worker_devices(self) -> tuple:
        """The devices the replicas run on, as TF-style names."""
        return tuple(device_name(d) for d in self._devices)

    @property
    def parameter_devices(self) -> tuple:
        """The devices variables are stored on (every replica's, or the central one)."""
        if self._parameter_device is None:
            return self.worker_devices
        return (device_name(self._parameter_device),)

    def _compute_value(self, variable):
        """A mirrored variable's value as the compiled program takes it: replicated."""
        return self._replicate(variable._value)

    def _to_storage(self, replicated):
        """A replicated new value, stored the way this strategy keeps variables."""
        if self._parameter_device is None:
            return replicated
        for shard in replicated.addressable_shards:
            if shard.device == self._parameter_device:
                return shard.data
        return jax.device_put(replicated.addressable_data(0), self._parameter_device)

    def _gated(self, fn, *args):
        return GATE.call(self._serialize, fn, *args)

    # --------------------------------------------------------------- placement
    def _put(self, value, sharding):
        """``value`` (host or local) stored with ``sharding``, without communication.

        On one process this is ``jax.device_put``. Across processes
        ``device_put`` would first check with a collective that every process
        passes the same value; callers here guarantee it (or, for first
        values of variables, replace it with worker 0's afterwards).
        """
        if not self._multi_process:
            return jax.device_put(value, sharding)
        if isinstance(value, jax.Array) and not value.is_fully_addressable:
            if value.sharding == sharding:
                return value
            return _resharding(sharding)(value)
        host = np.asarray(jnp.asarray(value))
        return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])

    def _put_local_rows(self, stacked):
        """This process's ``(local_replicas, ...)`` rows as a global stacked array."""
        if not self._multi_process:
            return jax.device_put(stacked, self._split)
        shape = (self._num_replicas_in_sync,) + tuple(np.shape(stacked)[1:])
        return jax.make_array_from_process_local_data(self._split, np.asarray(stacked), shape)

    def _all_rows(self, stacked):
        """A stacked array with every process's rows, on this process (an all-gather)."""
        if not self._multi_process:
            return stacked
        return self._gated(self._put, stacked, self._replicated).addressable_data(0)

    def _cross_process_sum(self, tree):
        """Adds a pytree of local arrays over processes (one collective); local results."""
        if not self._multi_process:
            return tree
        leaves, treedef = jax.tree_util.tree_flatten(tree)
        # This process's total goes in its first replica's row, zeros in the others.
        stacked = []
        for leaf in leaves:
            leaf = np.asarray(leaf)
            rows = np.zeros((self._num_local_replicas,) + leaf.shape, leaf.dtype)
            rows[0] = leaf
            stacked.append(self._put_local_rows(rows))
        summed = self._cross_device_ops._reduce_components(self, ReduceOp.SUM, stacked)
        return jax.tree_util.tree_unflatten(treedef, [s.addressable_data(0) for s in summed])

    def _agree_on_host_random_state(self):
        """Gives every process worker 0's NumPy global random state (one collective)."""
        if not self._multi_process:
            return
        name, keys, position, has_gauss, cached = np.random.get_state()
        packed = np.concatenate(
            [
                keys.astype(np.uint32),
                np.array([position, has_gauss], np.uint32),
                np.array([cached], np.float64).view(np.uint32),
            ]
        ).view(np.int32)
        if self._worker_index != 0:
            packed = np.zeros_like(packed)  # the sum is then worker 0's, bit for bit
        agreed = np.asarray(self._cross_process_sum(packed), np.int32).view(np.uint32)
        cached = float(agreed[-2:].view(np.float64)[0])
        np.random.set_state((name, agreed[: len(keys)], int(agreed[-4]), int(agreed[-3]), cached))

    def _sync_initial_values(self):
        """Gives every process worker 0's first values (TF broadcasts them from the chief)."""
        variables = [v for v in (r() for r in self._unsynced) if v is not None]
        # A variable whose first value Keras has not stored yet waits for the next sync.
        waiting = [v for v in variables if _first_value(v) is None]
        self._unsynced = [weakref.ref(v) for v in waiting]
        waiting_ids = {id(v) for v in waiting}
        for variable in variables:
            variable._keras_dist_unsynced = id(variable) in waiting_ids
        mirrored = [
            v for v in variables if isinstance(v, MirroredVariable) and v._value is not None
        ]
        sync_on_read = [
            v for v in variables if isinstance(v, SyncOnReadVariable) and v._stacked is not None
        ]
        if not mirrored and not sync_on_read:
            return
        new_mirrored, new_stacked = self._gated(
            _broadcast_from_replica_0(self._mesh),
            [self._replicate(v._value) for v in mirrored],
            [v._stacked for v in sync_on_read],
        )
        for variable, value in zip(mirrored, new_mirrored):
            variable._value = value
        for variable, value in zip(sync_on_read, new_stacked):
            variable._stacked = value

    # --------------------------------------------------------------- variables
    def _create_variable(self, variable):
        """Keras's variable-creation hook: distributed class, registry, sharding."""
        if isinstance(variable, DistributedVariable):
            return self._storage
        if building_batch_norm() and not variable.trainable:
            # tf.keras keeps batch-norm statistics per replica (ON_READ, MEAN);
            # Keras 3 makes them plain variables. Under a strategy, TF's choice.
            variable._synchronization, variable._aggregation = "on_read", "mean"
        cls = SyncOnReadVariable if variable.synchronization == "on_read" else MirroredVariable
        set_variable_class(variable, cls)
        variable._distribute_strategy = self._container_strategy()
        engine = _context.current_frame().engine
        primary = engine.primary_for(variable) if hasattr(engine, "primary_for") else None
        if primary is not None:
            variable._keras_dist_primary = primary
            return self._storage
        self._variable_refs.append(weakref.ref(variable, self._forget_variable))
        self._variables_version += 1
        if self._multi_process:
            variable._keras_dist_unsynced = True
            self._unsynced.append(weakref.ref(variable))
        return self._storage if cls is MirroredVariable else self._replicated

    def _forget_variable(self, _ref):
        self._variables_version += 1

    def _variable_state(self) -> _VariableState:
        if self._unsynced:
            self._sync_initial_values()
        state = self._state_cache
        if state is None or state.version != self._variables_version:
            live = [v for v in (r() for r in self._variable_refs) if v is not None]
            self._variable_refs = [weakref.ref(v, self._forget_variable) for v in live]
            state = _VariableState(
                self._variables_version,
                [v for v in live if isinstance(v, MirroredVariable) and v._value is not None],
                [v for v in live if isinstance(v, SyncOnReadVariable) and v._stacked is not None],
            )
            self._state_cache = state
        return state

    def _broadcast_stacked(self, value):
        n = self._num_replicas_in_sync
        if isinstance(value, jax.Array) and not value.is_fully_addressable:
            value = value.addressable_data(0)
        value = jnp.asarray(value)
        return self._put(jnp.broadcast_to(value, (n,) + value.shape), self._split)

    def _stack_components(self, components):
        shapes = {tuple(jnp.shape(c)) for c in components}
        dtypes = {jnp.result_type(c) for c in components}
        if len(shapes) != 1 or len(dtypes) != 1:
            raise ValueError(
                "The per-replica components must have the same shape and dtype to be "
                f"combined on the mesh. Received: shapes={sorted(shapes)}, "
                f"dtypes={sorted(map(str, dtypes))}"
            )
        (shape,) = shapes
        arrays = [
            jax.device_put(jnp.reshape(jnp.asarray(c), (1,) + shape), d)
            for c, d in zip(components, self._devices)
        ]
        global_shape = (self._num_replicas_in_sync,) + shape
        return jax.make_array_from_single_device_arrays(global_shape, self._split, arrays)

    def _as_stacked(self, value: DistributedValues):
        stacked = value._stacked
        if isinstance(stacked, np.ndarray):
            if self._multi_process:
                return self._put_local_rows(stacked)
            return stacked  # host batch: the compiled step places it (see _input)
        if stacked is not None and stacked.sharding == self._split:
            return stacked
        return self._stack_components(value.values)

    def _replicate(self, value):
        if isinstance(value, jax.Array) and value.sharding == self._replicated:
            return value
        return self._put(value, self._replicated)

    def _unwrap_mirrored(self, value):
        if not isinstance(value, DistributedValues):
            return value
        if value._traced is not None:
            return value._local()
        if value._replicated is not None:
            return value._replicated
        if isinstance(value, Mirrored):
            return self._replicate(value.values[0])
        return value

    def _one_value(self, value):
        """A value every replica holds the same, as one array for cross-replica code."""
        if isinstance(value, DistributedValues):
            if value._traced is not None:
                return value._local()
            value = value.values[0]
        if isinstance(value, jax.core.Tracer):
            return value
        return self._replicate(value)

    def _for_every_replica(self, structure):
        """Cross-replica results handed back to replicas: each takes its device's copy."""

        def wrap(x):
            if isinstance(x, jax.Array) and not isinstance(x, jax.core.Tracer):
                return Mirrored(None, _replicated=self._replicate(x))
            return x

        return jax.tree_util.tree_map(wrap, structure)

    def _reduce_stacked(self, aggregation, stacked):
        """Cross-replica read of a SyncOnRead variable's components."""
        if aggregation == "only_first_replica":
            return self._replicate(self._unstack_first(stacked))
        op = ReduceOp.from_variable_aggregation(aggregation)
        return self._cross_device_ops._reduce_components(self, op, [stacked])[0]

    def _unstack_first(self, stacked):
        from keras_dist._values._distributed_values import unstack

        return unstack(stacked)[0]

    # ---------------------------------------------------------------- running
    def call_for_each_replica(self, fn, args=(), kwargs=None):
        if not callable(fn):
            raise TypeError(f"`fn` must be callable. Received: fn={fn!r}")
        args = tuple(args) if isinstance(args, (list, tuple)) else (args,)
        kwargs = kwargs or {}
        strategy = self._container_strategy()
        frame = _context.current_frame()
        if frame.strategy is strategy and frame.replica_context is not None:
            # Nested run inside one of our replicas: just call it.
            return fn(*args, **kwargs)
        if frame.strategy is strategy and getattr(frame.engine, "compiled", False):
            # From a merge_fn inside a compiled trace: the trace's replicas run it.
            return frame.engine.call_for_each_replica(fn, args, kwargs)
        for outer in _context.frames():
            if outer.strategy is not strategy:
                raise RuntimeError(
                    "Mixing different tf.distribute.Strategy objects: `run` of "
                    f"{type(strategy).__name__} was called inside a scope of "
                    f"{type(outer.strategy).__name__}. Received: strategy={strategy!r}"
                )
        if _config.functions_run_eagerly() or _has_uneven_components((args, kwargs)):
            return self._eager.run(fn, args, kwargs)
        return self._compiled.run(fn, args, kwargs)

    # ------------------------------------------------------------- reductions
    def _engine_of_traced(self, values):
        for v in values:
            if isinstance(v, DistributedValues) and v._traced is not None:
                return v._traced.engine
        return None

    def reduce_to(self, reduce_op, value, destinations, options=None):
        return self.batch_reduce_to(reduce_op, [(value, destinations)], options)[0]

    def batch_reduce_to(self, reduce_op, value_destination_pairs, options=None):
        reduce_op = ReduceOp.from_value(reduce_op)
        require_cross_replica(self._container_strategy(), "batch_reduce_to")
        values = [v for v, _ in value_destination_pairs]
        engine = self._engine_of_traced(values)
        if engine is not None:
            return engine.reduce_traced(reduce_op, values)
        results = [None] * len(values)
        distributed = []
        for i, value in enumerate(values):
            if isinstance(value, DistributedValues):
                distributed.append(i)
            else:
                results[i] = self._reduce_non_distributed(reduce_op, value)
        if distributed:
            stacked = [self._as_stacked(values[i]) for i in distributed]
            reduced = self._cross_device_ops._reduce_components(self, reduce_op, stacked)
            for i, r in zip(distributed, reduced):
                results[i] = self._place(r, value_destination_pairs[i][1])
        return results

    def _reduce_non_distributed(self, reduce_op, value):
        if reduce_op is ReduceOp.MEAN or self._num_replicas_in_sync == 1:
            return value
        if isinstance(value, (int, float)) and value == 0:
            return value
        raise ValueError(
            f"A non-DistributedValues value {value} cannot be reduced with the given "
            f"reduce op {reduce_op}. Give each replica its own value (a PerReplica, or "
            "a tensor computed in the replica), or use ReduceOp.MEAN. Received: "
            f"value={value!r}"
        )

    def _destination_devices(self, destinations):
        if destinations is None or isinstance(destinations, DistributedVariable):
            return self._devices
        if isinstance(destinations, DistributedValues):
            # As in TF, the result goes where the destination value lives, which
            # may be other devices than the replicas' (a Mirrored on one CPU).
            return _committed_devices(destinations) or self._devices
        if isinstance(destinations, (str, jax.Device)):
            return (resolve_device(destinations),)
        if isinstance(destinations, (list, tuple)):
            return tuple(resolve_device(d) for d in destinations)
        return self._devices

    def _place(self, replicated, destinations):
        devices = self._destination_devices(destinations)
        if devices == self._devices:
            return Mirrored(None, _replicated=replicated)
        value = replicated.addressable_data(0)
        return Mirrored(tuple(jax.device_put(value, d) for d in devices), _validate=False)

    def broadcast_to(self, tensor, destinations):
        require_cross_replica(self._container_strategy(), "broadcast_to")
        if isinstance(tensor, DistributedValues):
            tensor = self._unwrap_mirrored(tensor)
        return self._place(self._replicate(jnp.asarray(tensor)), destinations)

    def update(self, var, fn, args=(), kwargs=None, group=True):
        require_cross_replica(self._container_strategy(), "update")
        kwargs = kwargs or {}
        frame = _context.current_frame()
        per_replica = [
            a
            for a in jax.tree_util.tree_leaves((args, kwargs), is_leaf=_is_dv)
            if isinstance(a, PerReplica)
        ]
        if per_replica and isinstance(var, SyncOnReadVariable):
            return self._update_components(var, fn, args, kwargs, frame)
        args, kwargs = jax.tree_util.tree_map(self._unwrap_mirrored, (args, kwargs), is_leaf=_is_dv)
        with _context.push(_context.Frame(self._container_strategy(), None, engine=frame.engine)):
            return fn(var, *args, **kwargs)

    def _update_components(self, var, fn, args, kwargs, frame):
        """Applies ``fn`` to each replica's component with that replica's arguments."""
        strategy = self._container_strategy()
        if frame.engine is not None and getattr(frame.engine, "compiled", False):
            local = jax.tree_util.tree_map(
                lambda a: a._local() if isinstance(a, DistributedValues) else a,
                (args, kwargs),
                is_leaf=_is_dv,
            )
            with _context.push(
                _context.Frame(strategy, frame.engine.replica_context, engine=frame.engine)
            ):
                return fn(var, *local[0], **local[1])
        results = []
        for i in range(self._num_local_replicas):
            context = ReplicaContext(strategy, self._replica_offset + i, _eager_index=i)
            a, k = _select(i, (args, kwargs))
            with _context.push(_context.Frame(strategy, context)):
                results.append(fn(var, *a, **k))
        return regroup(results)

    # ------------------------------------------------- strategy-level helpers
    def _reduce(self, reduce_op, value, axis):
        if isinstance(value, DistributedValues) and value._traced is not None:
            return value._traced.engine.reduce_with_axis(reduce_op, value, axis)
        if axis is None:
            if not isinstance(value, DistributedValues):
                return self._reduce_non_distributed(reduce_op, value)
            if value._sum is not None:
                count = value._stacked.shape[0]
                return _mean_from_sum(reduce_op, value._sum.addressable_data(0), count)
            return _first(self.reduce_to(reduce_op, value, None))
        if not isinstance(value, DistributedValues):
            value = Mirrored((value,) * self._num_local_replicas, _validate=False)
        if value._stacked is not None:
            return _first(self._gated(_stacked_axis_reducer(reduce_op, axis), value._stacked))
        # Uneven components (e.g. a partial last batch): reduce each, then add up.
        target = self._devices[0]
        components = [jnp.asarray(c) for c in value.values]
        total = sum(jax.device_put(jnp.sum(c, axis=axis), target) for c in components)
        count = sum(c.shape[axis] for c in components)
        if self._multi_process:
            total, count = self._cross_process_sum((total, np.asarray(count)))
        if reduce_op is ReduceOp.SUM:
            return total
        return total / count

    def _gather(self, value, axis):
        if isinstance(value, DistributedValues) and value._traced is not None:
            return value._traced.engine.gather_traced(value, axis)
        if not isinstance(value, DistributedValues):
            value = Mirrored((value,) * self._num_local_replicas, _validate=False)
        if self._multi_process:
            return self._gather_across_processes(value.values, axis)
        target = self._devices[0]
        return jnp.concatenate(
            [jax.device_put(jnp.asarray(c), target) for c in value.values], axis=axis
        )

    def _gather_across_processes(self, components, axis):
        """Every replica's component, concatenated on ``axis``, on every process.

        Components may differ in size on ``axis`` (partial batches): the sizes
        are exchanged first, and each component travels padded to the largest.
        """
        components = [jnp.asarray(c) for c in components]
        axis = axis % components[0].ndim
        sizes = np.zeros(self._num_replicas_in_sync, np.int32)
        for i, c in enumerate(components):
            sizes[self._replica_offset + i] = c.shape[axis]
        sizes = np.asarray(self._cross_process_sum(sizes))
        largest = int(sizes.max())

        def pad(c):
            widths = [(0, 0)] * c.ndim
            widths[axis] = (0, largest - c.shape[axis])
            return jnp.pad(c, widths)

        everything = self._all_rows(self._stack_components([pad(c) for c in components]))
        pieces = [
            jax.lax.slice_in_dim(everything[i], 0, int(size), axis=axis)
            for i, size in enumerate(sizes)
        ]
        return jnp.concatenate(pieces, axis=axis)

    def _distribute_values_from_function(self, value_fn):
        n = self._num_replicas_in_sync
        per_replica = []
        for i, device in enumerate(self._devices):
            value = value_fn(ValueContext(self._replica_offset + i, n))
            per_replica.append(
                jax.tree_util.tree_map(lambda x, d=device: jax.device_put(x, d), value)
            )
        return regroup(per_replica, always_wrap=True)


def _is_dv(x):
    return isinstance(x, DistributedValues)


def _first_value(variable):
    if isinstance(variable, SyncOnReadVariable):
        return variable._stacked
    return variable._value


_RESHARDINGS: dict = {}


def _resharding(sharding):
    """A program that moves a global array to ``sharding`` (an all-gather for replication)."""
    if sharding not in _RESHARDINGS:
        _RESHARDINGS[sharding] = jax.jit(lambda x: x, out_shardings=sharding)
    return _RESHARDINGS[sharding]


_BROADCASTS: dict = {}


def _broadcast_from_replica_0(mesh):
    """A program giving every replica replica 0's mirrored values and components."""
    if mesh not in _BROADCASTS:

        def from_first(x):
            dtype = x.dtype
            if dtype == jnp.bool_:
                x = x.astype(jnp.int8)
            first = jax.lax.psum(jnp.where(jax.lax.axis_index(AXIS) == 0, x, 0), AXIS)
            return first.astype(dtype)

        def body(mirrored, stacked):
            return [from_first(x) for x in mirrored], [from_first(x) for x in stacked]

        _BROADCASTS[mesh] = jax.jit(
            jax.shard_map(
                body,
                mesh=mesh,
                in_specs=(P(), P(AXIS)),
                out_specs=(P(), P(AXIS)),
                check_vma=False,
            )
        )
    return _BROADCASTS[mesh]


def _committed_devices(value):
    """The devices of ``value``'s components when each is committed to its own device.

    ``None`` when the components are on the strategy's mesh (stacked, replicated
    or traced), are Python scalars, or were left on the default device.
    """
    if value._components is None:
        return None
    devices = []
    for component in value._components:
        if not isinstance(component, jax.Array) or not component.committed:
            return None
        component_devices = component.devices()
        if len(component_devices) != 1:
            return None
        devices.append(next(iter(component_devices)))
    if len(set(devices)) != len(devices):
        return None
    return tuple(devices)


def _select(index, structure):
    return jax.tree_util.tree_map(
        lambda x: x.values[index] if isinstance(x, DistributedValues) else x,
        structure,
        is_leaf=_is_dv,
    )


def _first(value):
    """A reduced value as one array on the first device (cheap: no copy)."""
    if isinstance(value, DistributedValues):
        if value._replicated is not None:
            return value._replicated.addressable_data(0)
        return value.values[0]
    if isinstance(value, jax.Array) and len(value.sharding.device_set) > 1:
        return value.addressable_data(0)
    return value


def _mean_from_sum(reduce_op, total, count):
    if reduce_op is ReduceOp.SUM:
        return total
    if jnp.issubdtype(total.dtype, jnp.integer):
        return total // count
    return total / count


_AXIS_REDUCERS: dict = {}


def _stacked_axis_reducer(reduce_op, axis):
    key = (reduce_op, axis)
    if key not in _AXIS_REDUCERS:

        def reduce(stacked):
            per_replica_axis = axis + 1 if axis >= 0 else axis
            if reduce_op is ReduceOp.SUM:
                return jnp.sum(stacked, axis=(0, per_replica_axis))
            return jnp.mean(stacked, axis=(0, per_replica_axis))

        _AXIS_REDUCERS[key] = jax.jit(reduce)
    return _AXIS_REDUCERS[key]


def _has_uneven_components(structure) -> bool:
    for leaf in jax.tree_util.tree_leaves(structure, is_leaf=_is_dv):
        if isinstance(leaf, PerReplica) and leaf._uneven_across_processes:
            return True
        if isinstance(leaf, PerReplica) and leaf._stacked is None and leaf._traced is None:
            shapes = {tuple(np.shape(c)) for c in leaf.values}
            if len(shapes) > 1:
                return True
    return False
