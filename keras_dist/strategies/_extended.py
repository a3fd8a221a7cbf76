"""`StrategyExtended`: the core contract between a strategy and the rest of keras_dist.

Every strategy's ``extended`` object derives from this class. Its members are
what keras_dist's engines, inputs, Keras integration and callbacks ask of
*every* strategy; abilities only some strategies have (a device mesh, remote
scheduling, creating variables) are separate interfaces in ``_capabilities``,
checked with ``isinstance``. The members, by concern:

* **Replicas and devices**: ``num_replicas_in_sync``, ``num_local_replicas``,
  ``local_devices``, ``worker_devices``.
* **Cluster role**: ``role`` (a ``ProcessRole``: which task this process is,
  whether it is the chief), ``num_workers``, ``worker_index``,
  ``spans_processes``.
* **Execution**: ``call_for_each_replica`` (``strategy.run``),
  ``keras_distribution`` (what Keras asks when it creates a variable), ``lock``
  (one thread at a time), ``barrier``.
* **Reductions and broadcasts**: ``reduce_to``, ``batch_reduce_to``,
  ``broadcast_to``, ``update`` (cross-replica only), ``reduce_value``,
  ``gather_value``, ``distribute_values_from_function``, ``unwrap_mirrored``.

The four cross-replica-only methods are template methods, as in TF's
``StrategyExtendedV2``: the public method checks the reduce op and the context
(they raise in a replica context: call them from a ``merge_call``), then calls
the ``_reduce_to`` & co. that a strategy implements. What TF code calls and
keras_dist never does (``parameter_devices``, ``should_checkpoint``,
``colocate_vars_with``, ...) is ``TensorFlowSurface``'s, with TF's defaults.
"""

import abc
import contextlib
import threading
from typing import Any

import jax
import keras
from jax.experimental import multihost_utils

from keras_dist import _context
from keras_dist._context import running_replica_context
from keras_dist._reduce_op import ReduceOp
from keras_dist._values._distributed_values import DistributedValues
from keras_dist._values._variables import DistributedVariable
from keras_dist.cluster_resolver._role import ProcessRole
from keras_dist.cluster_resolver._role import role_from_resolver

_CROSS_REPLICA_ONLY = (
    "Method requires being in cross-replica context, use get_replica_context().merge_call()"
)


def require_cross_replica(method: str) -> None:
    """Raises if called inside one of a strategy's replicas."""
    if running_replica_context() is not None:
        raise RuntimeError(f"{_CROSS_REPLICA_ONLY}. Received: a call to `{method}`.")


class TensorFlowSurface:
    """Members of TF's ``StrategyExtended`` that TF code calls and keras_dist does not.

    Their defaults are TF's for a strategy in one process; a strategy overrides
    one where TF's answer differs for it. (keras_dist's own callbacks ask
    ``role``, which these answers follow.)
    """

    @property
    def parameter_devices(self) -> tuple:
        """The devices variables are stored on."""
        return self.worker_devices

    @property
    def should_checkpoint(self) -> bool:
        """Whether this process should save checkpoints (the chief only)."""
        return self.role.is_chief

    @property
    def should_save_summary(self) -> bool:
        """Whether this process should write summaries (the chief only)."""
        return self.role.is_chief

    @property
    def experimental_should_init(self) -> bool:
        """Whether this process should run variable initializers."""
        return True

    @property
    def experimental_between_graph(self) -> bool:
        """Whether each worker runs its own program (multi-worker strategies)."""
        return False

    @property
    def experimental_require_static_shapes(self) -> bool:
        """Whether inputs must have static shapes.

        ``False``: partial batches are handled (split unevenly in custom loops,
        padded and masked in ``fit``).
        """
        return False

    def colocate_vars_with(self, colocate_with_variable):
        """A scope in which variables go where ``colocate_with_variable`` is.

        Every variable of a mirrored strategy is on every replica's device, so
        this changes nothing here; it exists for code written for TF.
        """
        return contextlib.nullcontext()

    def non_slot_devices(self, var_list) -> tuple:
        """The devices that hold state not tied to one variable (TF's v1 optimizers' counters).

        Every replica's device: such state is mirrored as the variables are.
        """
        return self.worker_devices

    def read_var(self, v):
        """``v``'s value read in the cross-replica context (a SyncOnRead variable's aggregate).

        >>> import keras, keras_dist as kd
        >>> strategy = kd.MirroredStrategy(["/cpu:0", "/cpu:1"])
        >>> with strategy.scope():
        ...     total = keras.Variable(0.0, synchronization="on_read", aggregation="sum")
        >>> _ = strategy.extended.update(total, lambda var, x: var.assign(x), args=(2.0,))
        >>> float(strategy.extended.read_var(total))
        4.0
        """
        require_cross_replica("read_var")
        if not isinstance(v, keras.Variable):
            raise TypeError(
                "`read_var` reads a variable (created in the strategy's scope). Received: "
                f"{v!r} of type {type(v).__name__}"
            )
        return v.value

    def update_non_slot(self, colocate_with, fn, args=(), kwargs=None, group=True):
        """Runs ``fn(*args, **kwargs)`` once, in the cross-replica context, for state that
        is not one variable's slot; ``colocate_with`` is ``non_slot_devices``'s answer.

        TF runs ``fn`` on each of those devices, where each writes its own copy;
        here one call writes every replica's copy of a variable, as ``update`` does.
        """
        require_cross_replica("update_non_slot")
        args, kwargs = jax.tree_util.tree_map(
            self.unwrap_mirrored,
            (tuple(args), dict(kwargs or {})),
            is_leaf=lambda x: isinstance(x, DistributedValues),
        )
        return fn(*args, **kwargs)

    def value_container(self, value) -> Any:
        """The distributed variable ``value`` belongs to, or ``value`` itself."""
        return value

    def variable_created_in_scope(self, v) -> bool:
        """Whether ``v`` was created in this strategy's scope (and so is one of its variables).

        >>> import keras, keras_dist as kd
        >>> strategy = kd.MirroredStrategy(["/cpu:0", "/cpu:1"])
        >>> with strategy.scope():
        ...     inside = keras.Variable(1.0)
        >>> outside = keras.Variable(1.0)
        >>> [strategy.extended.variable_created_in_scope(v) for v in (inside, outside)]
        [True, False]
        """
        return (
            isinstance(v, DistributedVariable) and v.distribute_strategy is self.container_strategy
        )

    def _replica_ctx_all_reduce(self, reduce_op, value, options=None):
        """``get_replica_context().all_reduce``; TF code and tests call it by this name.

        Call in a replica context.
        """
        replica_context = _context.get_replica_context()
        if replica_context is None:
            raise RuntimeError(
                "`_replica_ctx_all_reduce` must be called in a replica context, inside "
                "`strategy.run`. In the cross-replica context use `reduce_to`. "
                f"Received: value={value!r}"
            )
        return replica_context.all_reduce(reduce_op, value, options)


class StrategyExtended(TensorFlowSurface, abc.ABC):
    """Additional APIs for algorithms that need to be distribution-aware.

    Cross-replica-only methods (``reduce_to``, ``batch_reduce_to``,
    ``broadcast_to``, ``update``) raise in a replica context: call them from a
    ``merge_call``. Every strategy's extended object derives from this class
    and implements its abstract members (see the module docstring).

    >>> import keras_dist as kd
    >>> extended = kd.MirroredStrategy(["/cpu:0", "/cpu:1"]).extended
    >>> extended.num_local_replicas, extended.should_checkpoint
    (2, True)
    """

    def __init__(self, container_strategy):
        self._container_strategy_ref = container_strategy
        self._lock = threading.RLock()

    def _container_strategy(self):
        return self._container_strategy_ref

    @property
    def container_strategy(self):
        """The strategy this object extends."""
        return self._container_strategy_ref

    # ------------------------------------------------- replicas and devices
    @property
    @abc.abstractmethod
    def num_replicas_in_sync(self) -> int:
        """How many replicas take part in each step, all processes together."""

    @property
    def num_local_replicas(self) -> int:
        """How many of the replicas run in this process."""
        return len(self.local_devices)

    @property
    @abc.abstractmethod
    def local_devices(self) -> tuple:
        """This process's replicas' devices, as ``jax.Device`` objects."""

    @property
    @abc.abstractmethod
    def worker_devices(self) -> tuple:
        """The devices the replicas run on, as TF-style names."""

    # --------------------------------------------------------- cluster role
    @property
    def role(self) -> ProcessRole:
        """This process's task in its cluster (all ``None`` for one process)."""
        return role_from_resolver(None)

    @property
    def num_workers(self) -> int:
        """How many processes (TF workers) the replicas span."""
        return 1

    @property
    def worker_index(self) -> int:
        """This process's index among the workers (process id; the chief is 0)."""
        return 0

    @property
    def spans_processes(self) -> bool:
        """Whether the replicas are in several processes (of one mesh: ``MeshRuntime``)."""
        return False

    # ------------------------------------------------------------ execution
    @abc.abstractmethod
    def call_for_each_replica(self, fn, args=(), kwargs=None, *, eagerly=False):
        """Runs ``fn`` once per replica; ``strategy.run``. ``eagerly`` forces the eager engine."""

    @property
    def keras_distribution(self):
        """The ``keras.distribution.Distribution`` installed while the strategy is current.

        ``None`` lets Keras create plain variables; a strategy that gives one
        creates them itself (``_capabilities.OwnsVariables``).
        """
        return None

    @property
    def lock(self) -> threading.RLock:
        """Serializes calls into this strategy from several threads (``run``, ``fit``).

        A step donates every variable of the strategy to its program, so two
        threads running steps at once would each delete the other's buffers.
        """
        return self._lock

    def barrier(self, name: str) -> None:
        """Returns once every process of the job got here (nothing to wait for in one).

        Without a strategy across processes (``jax.distributed`` started by hand),
        JAX's own barrier.
        """
        if jax.process_count() > 1:
            multihost_utils.sync_global_devices(name)

    # --------------------------------------------- reductions and broadcasts
    def reduce_to(self, reduce_op, value, destinations, options=None):
        """Combines ``value`` across replicas onto ``destinations``. Cross-replica only."""
        reduce_op = ReduceOp.from_value(reduce_op)
        require_cross_replica("reduce_to")
        return self._reduce_to(reduce_op, value, destinations, options)

    def batch_reduce_to(self, reduce_op, value_destination_pairs, options=None):
        """Several ``reduce_to`` in one fused reduction. Cross-replica only."""
        reduce_op = ReduceOp.from_value(reduce_op)
        require_cross_replica("batch_reduce_to")
        return self._batch_reduce_to(reduce_op, list(value_destination_pairs), options)

    def broadcast_to(self, tensor, destinations):
        """Copies ``tensor`` to ``destinations`` as a ``Mirrored`` value. Cross-replica only."""
        require_cross_replica("broadcast_to")
        return self._broadcast_to(tensor, destinations)

    def update(self, var, fn, args=(), kwargs=None, group=True):
        """Runs ``fn(var, *args, **kwargs)`` to update ``var`` everywhere. Cross-replica only."""
        require_cross_replica("update")
        return self._update(var, fn, tuple(args), dict(kwargs or {}), group)

    @abc.abstractmethod
    def _reduce_to(self, reduce_op, value, destinations, options):
        """``reduce_to`` after its checks: ``reduce_op`` is a ``ReduceOp``."""

    @abc.abstractmethod
    def _batch_reduce_to(self, reduce_op, value_destination_pairs, options):
        """``batch_reduce_to`` after its checks: ``reduce_op`` is a ``ReduceOp``."""

    @abc.abstractmethod
    def _broadcast_to(self, tensor, destinations):
        """``broadcast_to`` after its checks."""

    @abc.abstractmethod
    def _update(self, var, fn, args, kwargs, group):
        """``update`` after its checks: ``args`` a tuple, ``kwargs`` a dict."""

    @abc.abstractmethod
    def reduce_value(self, reduce_op, value, axis):
        """``strategy.reduce``: across replicas, then along ``axis`` when given."""

    @abc.abstractmethod
    def gather_value(self, value, axis):
        """``strategy.gather``: the replicas' components concatenated along ``axis``."""

    @abc.abstractmethod
    def distribute_values_from_function(self, value_fn):
        """``strategy.experimental_distribute_values_from_function``."""

    def unwrap_mirrored(self, value):
        """A reduction's ``Mirrored`` result as the one array it holds; other values unchanged."""
        return value
