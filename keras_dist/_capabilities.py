"""What some strategies can do beyond the core contract, as interfaces checked with ``isinstance``.

Every strategy's ``extended`` object fulfils ``StrategyExtended``, the small core
contract (replicas, roles, running a function per replica, reductions). Some
abilities belong to some strategies only, and each is declared here as its own
interface, so code that needs one asks for it by type instead of probing for
attributes or relying on a ``None`` by convention:

* ``OwnsVariables``: the strategy creates Keras's variables itself (it gives
  Keras a ``keras.distribution.Distribution``) and can list the live ones.
* ``MeshRuntime``: the replicas are the devices of one ``jax.sharding.Mesh``
  (every mirrored strategy, ``OneDeviceStrategy``, ``TPUStrategy``): arrays are
  placed on it, programs run over it, variables are stored on it.
* ``RemoteScheduling``: functions are traced here and run by other processes,
  variables live on parameter servers (``ParameterServerStrategy``).

The strategy itself is declared here too, as ``DistributionStrategy`` (every
``kd.Strategy`` is one), so code handed an object can check that it is a
strategy before asking its ``extended`` object for an ability.

This module sits at the bottom of the package (it imports nothing of ours), so
engines, inputs and callbacks can check an ability without importing strategies.

>>> import keras_dist as kd
>>> isinstance(kd.MirroredStrategy(["/cpu:0"]).extended, MeshRuntime)
True
>>> isinstance(kd.get_strategy(), DistributionStrategy)
True
>>> isinstance(kd.get_strategy().extended, OwnsVariables)
False
"""

import abc


class DistributionStrategy(abc.ABC):
    """A strategy (``kd.Strategy`` derives from it): its ``extended`` object has the abilities."""

    @property
    @abc.abstractmethod
    def extended(self):
        """The ``StrategyExtended`` object: the core contract, and the abilities above."""


class OwnsVariables(abc.ABC):
    """A strategy that creates the variables made in its scope."""

    @abc.abstractmethod
    def create_variable(self, variable):
        """Keras's variable-creation hook: distribute ``variable``, return its layout."""

    @abc.abstractmethod
    def variable_state(self):
        """The live variables this strategy created, for a program to thread as state."""


class MeshRuntime(OwnsVariables):
    """A strategy whose replicas are the devices of one mesh (see ``docs/architecture.md``).

    Its inputs are split over the mesh's ``replica`` axis, its steps are compiled
    over the mesh, and its variables are stored there (``placement`` holds the
    primitives that put arrays on it).
    """

    @property
    @abc.abstractmethod
    def placement(self):
        """The mesh and the primitives that place arrays on it (``strategies._placement``)."""

    @property
    @abc.abstractmethod
    def first_local_replica_id(self) -> int:
        """The ``replica_id_in_sync_group`` of this process's first replica."""

    @property
    @abc.abstractmethod
    def cross_device_ops(self):
        """The ``CrossDeviceOps`` that reduces across replicas."""

    @abc.abstractmethod
    def compute_value(self, variable):
        """A mirrored variable's value as a compiled program takes it."""

    @abc.abstractmethod
    def store_computed(self, variable, value) -> None:
        """Stores the new value a compiled program gave a mirrored variable."""

    @abc.abstractmethod
    def sync_initial_values(self) -> None:
        """Gives every process the chief's first values (several processes only)."""

    @abc.abstractmethod
    def repeat_call(self, fn, args):
        """``run(fn, args)``'s compiled program as a ``RepeatCall`` for new per-replica
        inputs of the same layout, or ``None`` (``_engine/_repeat_call.py``)."""

    @abc.abstractmethod
    def run_again(self, call, stacked):
        """``call(stacked)`` where ``run`` would run the compiled engine now, else ``MISSED``."""

    @abc.abstractmethod
    def one_value(self, value):
        """A value every replica holds the same, as one array for cross-replica code."""

    @abc.abstractmethod
    def for_every_replica(self, structure):
        """Cross-replica results handed back to the replicas, one copy each."""

    @abc.abstractmethod
    def reduce_stacked(self, aggregation, stacked):
        """The cross-replica read of a SyncOnRead variable's stacked components."""

    @abc.abstractmethod
    def reduce_non_distributed(self, reduce_op, value):
        """A plain (not per-replica) value reduced across replicas."""

    @abc.abstractmethod
    def agree_on_host_random_state(self) -> None:
        """Gives every process worker 0's NumPy random state (several processes only)."""


class RemoteScheduling(OwnsVariables):
    """A strategy that schedules traced functions onto workers, variables on ps tasks.

    What ``kd.coordinator.ClusterCoordinator``, the scheduled ``fit`` steps and
    the parameter-server variables ask of it.
    """

    @property
    @abc.abstractmethod
    def cluster_spec(self):
        """The cluster's ``ClusterSpec`` (workers and ps tasks)."""

    @property
    @abc.abstractmethod
    def parameter_servers(self):
        """The client of the ps tasks (``ParameterServers``)."""

    @property
    @abc.abstractmethod
    def programs(self):
        """The cache of traced programs (``ProgramCache``), one per function and signature."""

    @property
    @abc.abstractmethod
    def coordinator(self):
        """The strategy's ``ClusterCoordinator`` once made, else ``None``."""

    @abc.abstractmethod
    def attach_coordinator(self, coordinator) -> None:
        """Records the strategy's one ``ClusterCoordinator``."""

    @property
    @abc.abstractmethod
    def step_devices(self) -> tuple:
        """The devices one scheduled step runs on in this process."""

    @property
    @abc.abstractmethod
    def schedules_on_workers(self) -> bool:
        """Whether this process schedules steps onto workers that read the data (a coordinator)."""

    @property
    @abc.abstractmethod
    def consistency_epoch(self) -> int:
        """Changes when workers must read every variable afresh (a join or a write here)."""

    @abc.abstractmethod
    def new_consistency_epoch(self) -> None:
        """Makes the next scheduled functions read every variable afresh."""

    @abc.abstractmethod
    def set_settle(self, settle) -> None:
        """What to wait for before a read here: a weak reference to ``fit``'s steps' ``settle``."""

    @abc.abstractmethod
    def settle(self) -> None:
        """Waits for scheduled steps, so a read here sees their writes."""

    @abc.abstractmethod
    def live_variables(self) -> list:
        """The variables this strategy created that are alive and stored, in creation order."""

    @abc.abstractmethod
    def training_steps(self, model):
        """The functions Keras's ``fit``/``evaluate``/``predict`` call for ``model``."""
