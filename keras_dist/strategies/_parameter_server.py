"""`ParameterServerStrategy`: variables on parameter-server tasks, steps on workers.

Two ways to run, as in TF:

* **Coordinator** (TF2, the chief or a process outside the cluster): variables
  live on the ps tasks, placed round-robin in creation order (or split into
  shards by ``variable_partitioner``), and a ``kd.coordinator.ClusterCoordinator``
  sends functions to the workers.
* **Between-graph** (TF1, a ``worker`` task that runs the program itself):
  every worker creates the same variables (the first one to get there sets
  their values) and trains on them asynchronously with the other workers.

In a ``ps`` task, creating the strategy serves the task's variables until the
job ends, so one program can run on every task. The job ends when a ``chief``
task's program does: it tells the ps and worker servers to stop at its exit.
The runtime (servers, transport, programs) is ``keras_dist.parameter_server``.
"""

import logging
import uuid
import weakref

import jax
import jax.numpy as jnp

from keras_dist import _context
from keras_dist._capabilities import RemoteScheduling
from keras_dist._engine_contract import ReplicaEngine
from keras_dist._input import checked_input_options
from keras_dist._keras import StrategyDistribution
from keras_dist._keras import set_variable_class
from keras_dist._keras import slot_reference
from keras_dist._reduce_op import ReduceOp
from keras_dist._replica_context import ReplicaContext
from keras_dist._values import DistributedValues
from keras_dist._values._value_context import ValueContext
from keras_dist.cluster_resolver import ClusterSpec
from keras_dist.cluster_resolver import TFConfigClusterResolver
from keras_dist.cluster_resolver._role import ProcessRole
from keras_dist.parameter_server._data import DirectDataset
from keras_dist.parameter_server._fit import ParameterServerSteps
from keras_dist.parameter_server._job import stop_servers_at_exit
from keras_dist.parameter_server.scheduling._program_cache import ProgramCache
from keras_dist.parameter_server.tasks._server import Server
from keras_dist.parameter_server.variables._client import Location
from keras_dist.parameter_server.variables._client import ParameterServers
from keras_dist.parameter_server.variables._client import Shard
from keras_dist.parameter_server.variables._client import ps_device
from keras_dist.parameter_server.variables._partitioners import shard_rows
from keras_dist.parameter_server.variables._ps_variable import PartitionedVariable
from keras_dist.parameter_server.variables._ps_variable import PSVariable
from keras_dist.parameter_server.variables._trace import current_trace
from keras_dist.strategies._extended import StrategyExtended
from keras_dist.strategies._strategy import Strategy

logger = logging.getLogger("keras_dist")

_PS_START_TIMEOUT = 120.0  # seconds the ps tasks get to start serving
_ALLOWED_TASK_TYPES = ("chief", "worker", "evaluator", "ps", None)
_NOT_SCHEDULED = (
    "A `tf.distribute.experimental.ParameterServerStrategy` method is invoked without using "
    "`ClusterCoordinator.schedule`. If you are not tracing a tf.function, this method is "
    "possibly executed on the coordinator, which can be slow. To properly dispatch "
    "functions to run on workers, methods like `run` or `reduce` should be used within a "
    "function passed to `tf.distribute.experimental.coordinator.ClusterCoordinator.schedule`."
)


def validate_cluster(cluster_spec: ClusterSpec, task_type) -> None:
    """TF's checks of a parameter-server cluster (its messages)."""
    jobs = cluster_spec.jobs
    if any(job not in _ALLOWED_TASK_TYPES for job in jobs):
        raise ValueError(
            f"Disallowed task type found in cluster spec. Allowed types are "
            f"{list(_ALLOWED_TASK_TYPES)} and the cluster spec is {cluster_spec.as_dict()}."
        )
    if task_type not in _ALLOWED_TASK_TYPES:
        raise ValueError(
            f"Unrecognized task_type: {task_type}, valid task types are: "
            f"{list(_ALLOWED_TASK_TYPES)}. Received: task_type={task_type!r}"
        )
    if "chief" in jobs and cluster_spec.num_tasks("chief") > 1:
        raise ValueError("There must be at most one 'chief' job.")
    if "evaluator" in jobs and cluster_spec.num_tasks("evaluator") > 1:
        raise ValueError("There must be at most one 'evaluator' job.")
    if "worker" not in jobs or cluster_spec.num_tasks("worker") < 1:
        raise ValueError(f"There must be at least one worker. Received: {cluster_spec.as_dict()}")
    if "ps" not in jobs or cluster_spec.num_tasks("ps") < 1:
        raise ValueError(f"There must be at least one ps. Received: {cluster_spec.as_dict()}")


class _OneReplica(ReplicaEngine):
    """The replica side of ``run`` on a worker's one device: collectives are identities."""

    compiled = True

    def merge_call(self, replica_context, merge_fn, args, kwargs):
        strategy = replica_context.strategy
        with _context.push(_context.Frame(strategy, None, engine=self)):
            return merge_fn(strategy, *args, **kwargs)

    def all_reduce(self, reduce_op, value):
        return value

    def all_gather(self, value, axis):
        return value


def _one(value):
    """A value of the one local replica: a ``DistributedValues`` unwrapped."""
    if isinstance(value, DistributedValues):
        return value.values[0]
    return value


class ParameterServerExtended(StrategyExtended, RemoteScheduling):
    """The contract for ``ParameterServerStrategy``: variables on ps tasks, one replica each."""

    def __init__(self, strategy, resolver, variable_partitioner):
        super().__init__(strategy)
        self.cluster_resolver = resolver
        self._cluster_spec = ClusterSpec(resolver.cluster_spec())
        # A coordinator outside the cluster's jobs (no task type) writes as the chief.
        has_task = resolver.task_type is not None and resolver.task_id is not None
        if has_task and resolver.task_type in ("chief", "worker", "ps"):
            try:  # (else a task that is not in its cluster waits for the ps tasks, then fails)
                self._cluster_spec.task_address(resolver.task_type, resolver.task_id)
            except ValueError as error:
                raise ValueError(
                    f"This process's task ({resolver.task_type}, index {resolver.task_id}) is "
                    "not in its cluster: fix the task in TF_CONFIG (or the resolver). Received: "
                    f"cluster={self._cluster_spec.as_dict()}; {error}"
                ) from None
        self._role = (
            ProcessRole(resolver.task_type, resolver.task_id, self.cluster_spec)
            if has_task
            else ProcessRole()
        )
        self._parameter_servers = ParameterServers(self.cluster_spec)
        if resolver.task_type != "ps":
            # Tasks start in any order: wait for the ps tasks, as TF's workers do.
            self.parameter_servers.wait_until_ready(_PS_START_TIMEOUT)
        self.variable_partitioner = variable_partitioner
        self._between_graph = resolver.task_type == "worker"
        # Between-graph workers create the same variables in the same order and
        # must agree on their keys; a coordinator's keys are its own.
        self._key_prefix = "bg" if self._between_graph else uuid.uuid4().hex[:8]
        self._created = 0
        self._next_ps = 0
        self._colocate_with = None
        self._variables: list = []
        self._distribution = StrategyDistribution(strategy)
        self._engine = _OneReplica()
        self._warned = False
        self._programs = ProgramCache(strategy)
        self._coordinator = None  # the strategy's ClusterCoordinator, once made
        self._settle = None  # waits for fit's scheduled steps before a read here
        # Workers may start a step from the values their previous step got back
        # while this stays the same; a join or a write here changes it.
        self._consistency_epoch = 0
        self._steps = weakref.WeakKeyDictionary()

    # ------------------------------------------------ the cluster's runtime
    @property
    def cluster_spec(self) -> ClusterSpec:
        return self._cluster_spec

    @property
    def parameter_servers(self) -> ParameterServers:
        return self._parameter_servers

    @property
    def programs(self) -> ProgramCache:
        return self._programs

    @property
    def coordinator(self):
        return self._coordinator

    def attach_coordinator(self, coordinator) -> None:
        self._coordinator = coordinator

    # ------------------------------------------------- replicas and devices
    @property
    def num_replicas_in_sync(self) -> int:
        # A worker task's local devices (coordinator mode or between-graph) split
        # each step's batch as one program (XLA's all-reduce joins them): a step's
        # function sees the whole batch, one replica, and its numbers are the
        # one-device step's. (TF reports a worker's GPUs and runs one replica per GPU.)
        return 1

    @property
    def local_devices(self) -> tuple:
        return (jax.local_devices()[0],)

    @property
    def step_devices(self) -> tuple:
        """The devices a step runs on: a between-graph worker's local devices, else one."""
        return tuple(jax.local_devices()) if self._between_graph else self.local_devices

    @property
    def worker_devices(self) -> tuple:
        return tuple(
            f"/device:{device.platform.upper()}:{device.id}" for device in self.step_devices
        )

    @property
    def parameter_devices(self) -> tuple:
        return tuple(ps_device(i) for i in range(self.parameter_servers.num_ps))

    # --------------------------------------------------------- cluster role
    @property
    def role(self) -> ProcessRole:
        return self._role

    @property
    def num_workers(self) -> int:
        return self.cluster_spec.num_tasks("worker")

    @property
    def worker_index(self) -> int:
        return self._role.task_id if self._between_graph else 0

    @property
    def should_checkpoint(self) -> bool:
        if self._between_graph:
            return "chief" not in self.cluster_spec.jobs and self._role.task_id == 0
        return True

    @property
    def should_save_summary(self) -> bool:
        return self.should_checkpoint

    @property
    def schedules_on_workers(self) -> bool:
        return not self._between_graph

    @property
    def experimental_between_graph(self) -> bool:
        return self._between_graph

    # ------------------------------------------------------------ variables
    @property
    def keras_distribution(self):
        return self._distribution

    def create_variable(self, variable):
        if isinstance(variable, PSVariable):
            return None
        if current_trace() is not None:
            raise ValueError(
                "Variables cannot be created inside a function given to "
                "`ClusterCoordinator.schedule` or `create_per_worker_dataset`: create them in "
                f"`strategy.scope()` beforehand. Received: a new variable {variable.path!r}"
            )
        shape = tuple(variable.shape)
        # An optimizer slot goes beside its variable, shard by shard (as TF
        # colocates slots): the ps task applies the variable's update alone.
        reference = slot_reference()
        beside = None
        if isinstance(reference, PSVariable) and tuple(reference.shape) == shape:
            beside = reference.location.shards if self._colocate_with is None else None
        if beside is not None:
            rows = [shard.rows for shard in beside]
        else:
            rows = shard_rows(shape, variable.dtype, self.variable_partitioner) if shape else [None]
        set_variable_class(variable, PartitionedVariable if len(rows) > 1 else PSVariable)
        variable.attach_to(self.container_strategy)
        shards = []
        for n, count in enumerate(rows):
            if self._colocate_with is not None:
                task = self._colocate_with.location.shards[0].task
            elif beside is not None:
                task = beside[n].task
            else:
                task = self._next_ps % self.parameter_servers.num_ps
                self._next_ps += 1
            key = f"{self._key_prefix_for(variable)}/{self._created}/{variable.path}/{n}"
            shards.append(Shard(task, key, count))
        self._created += 1
        location = Location(tuple(shards), shape, str(variable.dtype))
        variable.bind(location, self.parameter_servers, if_absent=self._between_graph)
        self._variables.append(weakref.ref(variable))
        return None

    def training_steps(self, model):
        steps = self._steps.get(model)
        if steps is None:
            steps = self._steps[model] = ParameterServerSteps(model, self.container_strategy)
        return steps

    @property
    def consistency_epoch(self) -> int:
        return self._consistency_epoch

    def new_consistency_epoch(self) -> None:
        """Makes the next scheduled functions read every variable afresh."""
        self._consistency_epoch += 1

    def set_settle(self, settle) -> None:
        """What to wait for before the coordinator reads a variable: a weak reference to
        fit's steps' ``settle`` (a dropped model's steps are not kept alive here)."""
        self._settle = settle

    def settle(self) -> None:
        """Waits for scheduled ``fit`` steps, so a read here sees their writes."""
        settle = self._settle() if self._settle is not None else None
        if settle is not None and current_trace() is None:
            settle()

    def _key_prefix_for(self, variable) -> str:
        # Between-graph, each worker keeps its own metrics (TF1's local variables):
        # on-read variables get keys of their own on every worker.
        if self._between_graph and variable.synchronization == "on_read":
            return f"{self._key_prefix}{self._role.task_id}"
        return self._key_prefix

    def live_variables(self) -> list:
        """The variables this strategy created that are alive and stored, in creation order."""
        live = [v for v in (r() for r in self._variables) if v is not None]
        self._variables = [weakref.ref(v) for v in live]
        return [v for v in live if v.stored_on_servers]

    def variable_state(self):
        return self.live_variables()

    def colocate_vars_with(self, colocate_with_variable):
        """A scope in which new variables go to ``colocate_with_variable``'s ps task."""
        return _Colocate(self, colocate_with_variable)

    def set_colocation(self, variable) -> None:
        """Sets (or with ``None`` clears) the variable new ones are placed beside."""
        self._colocate_with = variable

    # ------------------------------------------------------------ execution
    def _warn_unless_scheduled(self) -> None:
        if current_trace() is None and not self._between_graph and not self._warned:
            self._warned = True
            logger.warning(_NOT_SCHEDULED)

    def call_for_each_replica(self, fn, args=(), kwargs=None, *, eagerly=False):
        self._warn_unless_scheduled()
        args = jax.tree_util.tree_map(
            _one, args, is_leaf=lambda x: isinstance(x, DistributedValues)
        )
        kwargs = jax.tree_util.tree_map(
            _one, kwargs or {}, is_leaf=lambda x: isinstance(x, DistributedValues)
        )
        strategy = self.container_strategy
        context = ReplicaContext(strategy, 0, _engine=self._engine)
        with _context.push(_context.Frame(strategy, context, engine=self._engine)):
            return fn(*args, **kwargs)

    # --------------------------------------------- reductions and broadcasts
    def _reduce_to(self, reduce_op, value, destinations, options):
        return _one(value)

    def _batch_reduce_to(self, reduce_op, value_destination_pairs, options):
        return [_one(value) for value, _ in value_destination_pairs]

    def _broadcast_to(self, tensor, destinations):
        return tensor

    def _update(self, var, fn, args, kwargs, group):
        return fn(var, *args, **kwargs)

    def reduce_value(self, reduce_op, value, axis):
        self._warn_unless_scheduled()

        def one(x):
            x = _one(x)
            if axis is None:
                return x
            reduce = jnp.sum if reduce_op == ReduceOp.SUM else jnp.mean
            return reduce(jnp.asarray(x), axis=axis)

        return jax.tree_util.tree_map(
            one, value, is_leaf=lambda x: isinstance(x, DistributedValues)
        )

    def gather_value(self, value, axis):
        return _one(value)

    def distribute_values_from_function(self, value_fn):
        return value_fn(ValueContext(0, 1))


class _Colocate:
    def __init__(self, extended, variable):
        self._extended = extended
        self._variable = variable

    def __enter__(self):
        self._extended.set_colocation(self._variable)

    def __exit__(self, *exc_info):
        self._extended.set_colocation(None)


class ParameterServerStrategy(Strategy):
    """Asynchronous training with variables on parameter servers (``tf.distribute``'s).

    Args:
        cluster_resolver: the cluster (``chief``, ``worker``, ``ps``, ``evaluator``
            jobs); ``TFConfigClusterResolver()`` by default.
        variable_partitioner: called with ``(shape, dtype)`` for each variable
            created in the scope; returns the number of shards along the first
            axis (see ``kd.experimental.partitioners``). ``None``: no sharding.

    On the coordinator, use it with ``kd.coordinator.ClusterCoordinator``; in a
    worker task it trains between-graph; in a ps task it serves until the job ends,
    then ends the task's program (``SystemExit(0)``). A ``chief`` task's program
    ends the job: at its exit it tells every ps and worker server to stop.

    >>> import keras, keras_dist as kd
    >>> resolver = kd.testing.create_in_process_cluster(num_workers=1, num_ps=2)
    >>> strategy = kd.ParameterServerStrategy(resolver)
    >>> with strategy.scope():
    ...     a, b = keras.Variable(1.0), keras.Variable(2.0)
    >>> a.device, b.device
    ('/job:ps/replica:0/task:0/device:CPU:0', '/job:ps/replica:0/task:1/device:CPU:0')
    """

    def __init__(self, cluster_resolver=None, variable_partitioner=None):
        resolver = cluster_resolver if cluster_resolver is not None else TFConfigClusterResolver()
        spec = ClusterSpec(resolver.cluster_spec())
        validate_cluster(spec, resolver.task_type)
        self._cluster_resolver = resolver
        super().__init__(ParameterServerExtended(self, resolver, variable_partitioner))
        if resolver.task_type == "chief":
            # The job ends with the chief: its servers stop too, however the tasks were started.
            stop_servers_at_exit(spec)
        if resolver.task_type == "ps":
            server = Server(resolver, "ps", resolver.task_id)
            logger.info("ps task %s serves until the job ends", resolver.task_id)
            server.join()
            # The chief ended the job. Returning would run the rest of the program,
            # the chief's part, in this task: the task's program ends here instead.
            logger.info("ps task %s: the job ended", resolver.task_id)
            raise SystemExit(0)

    @property
    def cluster_resolver(self):
        """The resolver the strategy was created with."""
        return self._cluster_resolver

    def experimental_distribute_dataset(self, dataset, options=None):
        """A dataset for ``create_per_worker_dataset``; iterating it here raises."""
        checked_input_options(options, "experimental_distribute_dataset")
        return DirectDataset(lambda: dataset)

    def distribute_datasets_from_function(self, dataset_fn, options=None):
        """A dataset built by ``dataset_fn(InputContext)``, for ``create_per_worker_dataset``."""
        checked_input_options(options, "distribute_datasets_from_function")
        return DirectDataset(dataset_fn)

    def __reduce__(self):
        # A dataset function sent to the workers may capture the strategy
        # (TF's tutorial calls `strategy.distribute_datasets_from_function` in
        # it); on a worker it only needs to build datasets.
        return (_WorkerSideStrategy, ())

    def __repr__(self):
        return f"ParameterServerStrategy(cluster={self._cluster_resolver.cluster_spec()})"


class _WorkerSideStrategy:
    """What a ``ParameterServerStrategy`` captured by a dataset function is on a worker."""

    def experimental_distribute_dataset(self, dataset, options=None):
        return dataset

    def distribute_datasets_from_function(self, dataset_fn, options=None):
        return DirectDataset(dataset_fn)

    experimental_distribute_datasets_from_function = distribute_datasets_from_function
