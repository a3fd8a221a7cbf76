"""The extended API of strategies whose replicas are the devices of one mesh.

``MirroredStrategy``, ``OneDeviceStrategy``, ``CentralStorageStrategy`` and
``MultiWorkerMirroredStrategy`` share it. It composes the pieces that each hold
one concept: the ``Placement`` (mesh, shardings, moving arrays), the
``VariableRegistry`` (variable policy), the engines (running ``fn`` per
replica) and the cross-replica reductions (``_mesh_reductions``).
"""

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from keras_dist import _context
from keras_dist._capabilities import MeshRuntime
from keras_dist._cross_device_ops import CrossDeviceOps
from keras_dist._cross_device_ops import select_cross_device_ops
from keras_dist._devices import device_name
from keras_dist._engine import MISSED
from keras_dist._engine import CompiledEngine
from keras_dist._engine import EagerEngine
from keras_dist._engine import LogicalDevicesEngine
from keras_dist._engine import UnevenEngine
from keras_dist._engine import run_inline
from keras_dist._engine_contract import TracedMerge
from keras_dist._jax_trace import refuse_foreign_trace
from keras_dist._keras import StrategyDistribution
from keras_dist._mesh import replica_mesh
from keras_dist._reduce_op import ReduceOp
from keras_dist._values import DistributedValues
from keras_dist._values import Mirrored
from keras_dist._values import PerReplica
from keras_dist._values._value_context import ValueContext
from keras_dist._values._variables import SyncOnReadVariable
from keras_dist.config import _switches as _config
from keras_dist.strategies import _mesh_reductions
from keras_dist.strategies._extended import StrategyExtended
from keras_dist.strategies._placement import Placement
from keras_dist.strategies._variable_registry import VariableRegistry


class MeshExtended(StrategyExtended, MeshRuntime):
    """Extended API over a ``(replica, logical)`` mesh of devices.

    ``devices`` are this process's replicas. ``mesh_devices``, when given, are
    every process's (multi-worker strategies): the mesh spans them, and values
    this process holds are its rows of global arrays. ``parameter_device``,
    when given, is where mirrored variables are stored (central storage).
    ``cores_per_replica > 1`` makes each replica span that many consecutive
    ``devices`` (its logical devices: model parallelism inside a replica).
    """

    # Whether a sync-on-read variable reads as its one component whatever its
    # aggregation ("none" included), as TF's OneDeviceStrategy's plain variables do.
    reads_sync_on_read_as_plain = False

    def __init__(
        self,
        container_strategy,
        devices,
        cross_device_ops=None,
        parameter_device=None,
        mesh_devices=None,
        dispatch=None,
        cores_per_replica=1,
    ):
        super().__init__(container_strategy)
        if cross_device_ops is not None and not isinstance(cross_device_ops, CrossDeviceOps):
            raise TypeError(
                "`cross_device_ops` must be a keras_dist.CrossDeviceOps such as "
                f"kd.NcclAllReduce(). Received: cross_device_ops={cross_device_ops!r}"
            )
        self._cross_device_ops = cross_device_ops or select_cross_device_ops(devices)
        self._cross_device_ops.check_devices()
        self._placement = Placement(
            devices, mesh_devices, dispatch, self._cross_device_ops, cores_per_replica
        )
        self._parameter_device = parameter_device
        storage = (
            self._placement.replicated
            if parameter_device is None
            # A named sharding (Keras's initializers ask for its mesh).
            else NamedSharding(replica_mesh([parameter_device]), P())
        )
        self._registry = VariableRegistry(container_strategy, self._placement, storage)
        self._keras_distribution = StrategyDistribution(container_strategy)
        engine = CompiledEngine if cores_per_replica == 1 else LogicalDevicesEngine
        self._compiled = engine(self)
        self._eager = EagerEngine(self)
        self._uneven = UnevenEngine(self, self._compiled)

    # ------------------------------------------------- replicas and devices
    @property
    def num_replicas_in_sync(self) -> int:
        return self._placement.num_replicas

    @property
    def local_devices(self) -> tuple:
        return self._placement.local_devices

    @property
    def first_local_replica_id(self) -> int:
        return self._placement.first_local_replica_id

    @property
    def placement(self) -> Placement:
        return self._placement

    @property
    def spans_processes(self) -> bool:
        return self._placement.spans_processes

    @property
    def worker_devices(self) -> tuple:
        """The devices the replicas run on, as TF-style names."""
        return tuple(device_name(d) for d in self.local_devices)

    @property
    def parameter_devices(self) -> tuple:
        """The devices variables are stored on (every replica's, or the central one)."""
        if self._parameter_device is None:
            return self.worker_devices
        return (device_name(self._parameter_device),)

    # ------------------------------------------------------------ variables
    @property
    def keras_distribution(self):
        return self._keras_distribution

    @property
    def _variables_version(self) -> int:
        return self._registry.version

    def create_variable(self, variable):
        engine = _context.current_frame().engine
        return self._registry.create(variable, engine)

    def variable_state(self):
        return self._registry.state()

    def sync_initial_values(self) -> None:
        self._registry.sync_initial_values()

    def compute_value(self, variable):
        """A mirrored variable's value as the compiled program takes it: replicated."""
        return self._placement.replicate(variable.stored())

    def store_computed(self, variable, value) -> None:
        """Stores a replicated new value the way this strategy keeps variables."""
        if self._parameter_device is None:  # (the common case: once per variable a step)
            variable.store(value)
        else:
            variable.store(self._to_storage(value))

    def _to_storage(self, replicated):
        for shard in replicated.addressable_shards:
            if shard.device == self._parameter_device:
                return shard.data
        return jax.device_put(replicated.addressable_data(0), self._parameter_device)

    def agree_on_host_random_state(self) -> None:
        self._placement.agree_on_host_random_state(self.worker_index)

    def barrier(self, name: str) -> None:
        if not self.spans_processes:
            return super().barrier(name)
        # One small collective through the strategy: a lost peer is reported by name.
        self._placement.cross_process_sum(np.zeros((), np.int32))

    # ------------------------------------------------------------ execution
    def call_for_each_replica(self, fn, args=(), kwargs=None, *, eagerly=False):
        if not callable(fn):
            raise TypeError(f"`fn` must be callable. Received: fn={fn!r}")
        args = tuple(args) if isinstance(args, (list, tuple)) else (args,)
        kwargs = kwargs or {}
        strategy = self._container_strategy()
        frame = _context.current_frame()
        if frame.strategy is strategy and frame.replica_context is not None:
            # Nested run inside one of our replicas: just call it.
            return fn(*args, **kwargs)
        if frame.strategy is strategy and isinstance(frame.engine, TracedMerge):
            # From a merge_fn inside a compiled trace: the trace's replicas run it.
            return frame.engine.call_for_each_replica(fn, args, kwargs)
        function_trace = _context.current_function_trace()
        if function_trace is not None:
            if function_trace.jax_trace is not None:
                refuse_foreign_trace("`strategy.run`", function_trace.jax_trace)
            # Inside a kd.function: the replicas join the function's program.
            return run_inline(self._compiled, self, fn, args, kwargs, function_trace)
        refuse_foreign_trace("`strategy.run`")
        outer = _context.other_strategy_in_scope(strategy)
        if outer is not None:
            raise RuntimeError(
                "Mixing different tf.distribute.Strategy objects: `run` of "
                f"{type(strategy).__name__} was called inside a scope of "
                f"{type(outer).__name__}. Received: strategy={strategy!r}"
            )
        with self._lock:
            if eagerly or _config.functions_run_eagerly():
                return self._eager.run(fn, args, kwargs)
            if _has_uneven_components((args, kwargs)):
                return self._uneven.run(fn, args, kwargs)
            return self._compiled.run(fn, args, kwargs)

    def repeat_call(self, fn, args):
        """``run(fn, args)``'s compiled program as a ``RepeatCall`` for new per-replica
        inputs of the same layout, or ``None`` (see ``CompiledEngine.repeat_call``)."""
        if not self._runs_compiled_now():
            return None
        return self._compiled.repeat_call(fn, tuple(args), {})

    def run_again(self, call, stacked):
        """``call(stacked)`` where ``run`` would run the compiled engine now, else ``MISSED``."""
        if not self._runs_compiled_now():
            return MISSED
        with self._lock:
            return call(stacked)

    def _runs_compiled_now(self) -> bool:
        """Whether ``run`` here goes to the compiled engine: in this strategy's
        cross-replica context, outside any trace, and not run eagerly."""
        frame = _context.current_frame()
        return (
            frame.replica_context is None
            and frame.engine is None
            and _context.current_function_trace() is None
            and _context.other_strategy_in_scope(self._container_strategy()) is None
            and not _config.functions_run_eagerly()
        )

    # --------------------------------------------- reductions and broadcasts
    @property
    def cross_device_ops(self) -> CrossDeviceOps:
        return self._cross_device_ops

    def _reduce_to(self, reduce_op, value, destinations, options):
        return self._batch_reduce_to(reduce_op, [(value, destinations)], options)[0]

    def _batch_reduce_to(self, reduce_op, value_destination_pairs, options):
        values = [v for v, _ in value_destination_pairs]
        engine = _engine_of_traced(values)
        if engine is not None:
            return engine.reduce_traced(reduce_op, values)
        results = [None] * len(values)
        distributed = []
        for i, value in enumerate(values):
            if isinstance(value, DistributedValues):
                distributed.append(i)
            else:
                results[i] = self.reduce_non_distributed(reduce_op, value)
        in_program = [i for i in distributed if _stacked_in_program(values[i])]
        for i in in_program:
            # Inside a kd.function: a global reduction joins the function's program.
            reduced = _mesh_reductions.reduce_stacked_in_program(reduce_op, values[i], None)
            results[i] = self._traced_mirrored(reduced)
        distributed = [i for i in distributed if i not in in_program]
        if distributed:
            stacked = [self._placement.as_stacked(values[i]) for i in distributed]
            reduced = self._cross_device_ops.reduce_components(
                self._placement, reduce_op, stacked, true_mean=not self.spans_processes
            )
            for i, r in zip(distributed, reduced):
                results[i] = self._place(r, value_destination_pairs[i][1])
        return results

    def reduce_non_distributed(self, reduce_op, value):
        if reduce_op is ReduceOp.MEAN or self.num_replicas_in_sync == 1:
            return value
        if isinstance(value, (int, float)) and value == 0:
            return value
        raise ValueError(
            f"A non-DistributedValues value {value} cannot be reduced with the given "
            f"reduce op {reduce_op}. Give each replica its own value (a PerReplica, or "
            "a tensor computed in the replica), or use ReduceOp.MEAN. Received: "
            f"value={value!r}"
        )

    def _stacked_in_program(self, *components):
        """Per-replica values inside a compiled program: one array split over the replicas."""
        shapes = {jnp.shape(c) for c in components}
        if len(shapes) > 1:
            raise ValueError(
                "Inside a kd.function, the values of "
                "`experimental_distribute_values_from_function` must have the same shape "
                "on every replica (one compiled program holds them stacked). Give every "
                "replica the same shape, or call it outside the kd.function. Received: "
                f"shapes={sorted(shapes)}"
            )
        stacked = jnp.stack([jnp.asarray(c) for c in components])
        stacked = jax.lax.with_sharding_constraint(stacked, self._placement.split)
        return PerReplica(None, _stacked=stacked)

    def _traced_mirrored(self, value):
        """A value every replica shares inside a compiled program: one traced array."""
        copies = (value,) * self.num_local_replicas
        return Mirrored(copies, _replicated=value, _validate=False)

    def _place(self, replicated, destinations):
        devices = _mesh_reductions.destination_devices(self.local_devices, destinations)
        if devices == self.local_devices:
            return Mirrored(None, _replicated=replicated)
        value = replicated.addressable_data(0)
        return Mirrored(tuple(jax.device_put(value, d) for d in devices), _validate=False)

    def _broadcast_to(self, tensor, destinations):
        if isinstance(tensor, DistributedValues):
            tensor = self.unwrap_mirrored(tensor)
        if _context.current_function_trace() is not None or isinstance(tensor, jax.core.Tracer):
            # Inside a compiled program, which places it; every replica reads it whole.
            return self._traced_mirrored(jnp.asarray(tensor))
        return self._place(self._placement.replicate(jnp.asarray(tensor)), destinations)

    def _update(self, var, fn, args, kwargs, group):
        frame = _context.current_frame()
        strategy = self._container_strategy()
        if isinstance(var, SyncOnReadVariable):
            # As TF: ``fn`` runs on each replica's component (a plain value is given
            # whole to each, so a SUM variable's read becomes the replicas' total).
            if isinstance(frame.engine, TracedMerge):
                return frame.engine.update_component(var, fn, args, kwargs)
            return self._eager.update_components(var, fn, args, kwargs)
        args, kwargs = jax.tree_util.tree_map(self.unwrap_mirrored, (args, kwargs), is_leaf=_is_dv)
        with _context.push(_context.Frame(strategy, None, engine=frame.engine)):
            return fn(var, *args, **kwargs)

    def unwrap_mirrored(self, value):
        if not isinstance(value, DistributedValues):
            return value
        if value.traced is not None:
            return value.local()
        if value.replicated is not None:
            return value.replicated
        if isinstance(value, Mirrored):
            return self._placement.replicate(value.values[0])
        return value

    def one_value(self, value):
        if isinstance(value, DistributedValues):
            if value.traced is not None:
                return value.local()
            value = value.values[0]
        if isinstance(value, jax.core.Tracer):
            return value
        return self._placement.replicate(value)

    def for_every_replica(self, structure):
        """Cross-replica results handed back to replicas: each takes its device's copy."""

        def wrap(x):
            if isinstance(x, jax.Array) and not isinstance(x, jax.core.Tracer):
                return Mirrored(None, _replicated=self._placement.replicate(x))
            return x

        return jax.tree_util.tree_map(wrap, structure)

    def reduce_stacked(self, aggregation, stacked):
        """Cross-replica read of a SyncOnRead variable's components (where the other
        variables are: on the central device of a CentralStorageStrategy)."""
        if aggregation == "only_first_replica":
            value = self._placement.first_component(stacked)
        else:
            op = ReduceOp.from_variable_aggregation(aggregation)
            value = self._cross_device_ops.reduce_components(self._placement, op, [stacked])[0]
        if self._parameter_device is None or isinstance(value, jax.core.Tracer):
            return value
        return self._to_storage(value)

    def reduce_value(self, reduce_op, value, axis):
        if isinstance(value, DistributedValues) and value.traced is not None:
            return value.traced.engine.reduce_with_axis(reduce_op, value, axis)
        if _stacked_in_program(value):
            # Inside a kd.function: a global reduction of the program's stacked result.
            return _mesh_reductions.reduce_stacked_in_program(reduce_op, value, axis)
        if axis is None:
            if not isinstance(value, DistributedValues):
                return self.reduce_non_distributed(reduce_op, value)
            if value.replica_sum is not None:
                count = value.stacked.shape[0]
                total = value.replica_sum.addressable_data(0)
                # Across workers TF's collectives divide integers as integers.
                integer_division = self.spans_processes
                return _mesh_reductions.mean_from_sum(reduce_op, total, count, integer_division)
            if reduce_op is ReduceOp.MEAN and _is_integer(value) and not self.spans_processes:
                # TF's MirroredStrategy divides integers into a float (replica ids 0..3
                # give 1.5); its collective ops across workers divide as integers.
                total = _mesh_reductions.first(self.reduce_to(ReduceOp.SUM, value, None))
                return total / self.num_replicas_in_sync
            return _mesh_reductions.first(self.reduce_to(reduce_op, value, None))
        if not isinstance(value, DistributedValues):
            value = Mirrored((value,) * self.num_local_replicas, _validate=False)
        return _mesh_reductions.reduce_along_axis(self._placement, reduce_op, value, axis)

    def gather_value(self, value, axis):
        if isinstance(value, DistributedValues) and value.traced is not None:
            return value.traced.engine.gather_traced(value, axis)
        if isinstance(value, PerReplica) and isinstance(value.stacked, jax.core.Tracer):
            return jnp.concatenate(list(value.values), axis=axis)
        if not isinstance(value, DistributedValues):
            return self._gather_plain(value, axis)
        return _mesh_reductions.gather(self._placement, value.values, axis)

    def _gather_plain(self, value, axis):
        """A value that is not distributed is one component per process, as in TF.

        One process gives it back unchanged (not once per replica); several give
        their values concatenated in process order.
        """
        value = jnp.asarray(value)
        if not self.spans_processes:
            return value
        if isinstance(value, jax.core.Tracer):  # one program: the same value everywhere
            return jnp.concatenate([value] * jax.process_count(), axis=axis)
        nothing = jax.lax.slice_in_dim(value, 0, 0, axis=axis)
        components = [value] + [nothing] * (self.num_local_replicas - 1)
        return _mesh_reductions.gather(self._placement, components, axis)

    def distribute_values_from_function(self, value_fn):
        n = self.num_replicas_in_sync
        if _context.current_function_trace() is not None:
            # Inside a kd.function: every replica's value, stacked in the program.
            values = [value_fn(ValueContext(i, n)) for i in range(n)]
            return jax.tree_util.tree_map(self._stacked_in_program, *values)
        per_replica = []
        for i, device in enumerate(self.local_devices):
            value = value_fn(ValueContext(self.first_local_replica_id + i, n))
            per_replica.append(
                jax.tree_util.tree_map(lambda x, d=device: jax.device_put(x, d), value)
            )
        values = _mesh_reductions.regroup_always(per_replica)
        if not self.spans_processes:
            # Alike components kept stacked too: a kd.function compiles for the value on
            # its first call (components per device are what uneven inputs look like).
            for leaf in jax.tree_util.tree_leaves(values, is_leaf=_is_dv):
                if isinstance(leaf, PerReplica) and _alike(leaf.values):
                    self._placement.as_stacked(leaf)
        return values


def _is_dv(x):
    return isinstance(x, DistributedValues)


def _alike(components) -> bool:
    """Whether per-replica components are arrays of one shape and dtype."""
    if not all(isinstance(c, jax.Array) for c in components):
        return False
    return len({(c.shape, c.dtype) for c in components}) == 1


def _stacked_in_program(value) -> bool:
    """A per-replica value held as a traced stacked array: inside a ``kd.function``."""
    return isinstance(value, PerReplica) and isinstance(value.stacked, jax.core.Tracer)


def _is_integer(value) -> bool:
    leaves = jax.tree_util.tree_leaves(value.values[:1])
    return bool(leaves) and all(jnp.issubdtype(jnp.result_type(x), jnp.integer) for x in leaves)


def _engine_of_traced(values):
    for v in values:
        if isinstance(v, DistributedValues) and v.traced is not None:
            return v.traced.engine
    return None


def _has_uneven_components(structure) -> bool:
    for leaf in jax.tree_util.tree_leaves(structure, is_leaf=_is_dv):
        if not isinstance(leaf, PerReplica):
            continue
        if leaf.uneven_across_processes:
            return True
        if leaf.stacked is None and leaf.traced is None:
            if len({tuple(np.shape(c)) for c in leaf.values}) > 1:
                return True
    return False
