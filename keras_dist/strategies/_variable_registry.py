"""The variables a mesh strategy created: its variable-creation policy and registry.

Keras asks the strategy's ``keras.distribution.Distribution`` for a layout
whenever it creates a variable under the strategy. The policy here answers:
it gives the variable its distributed class (``MirroredVariable`` or
``SyncOnReadVariable``), registers it (weakly: a dropped model's variables
are freed), and returns the sharding it is stored with. The compiled engine
threads every live registered variable through its programs as state.

Across processes every process initializes its own variables; before anything
reads them, one collective gives everyone worker 0's first values (TF
broadcasts the chief's).
"""

import weakref

from keras_dist._keras import building_batch_norm
from keras_dist._keras import make_per_replica_statistic
from keras_dist._keras import set_variable_class
from keras_dist._keras import share_variable_state
from keras_dist._values._variables import MirroredVariable
from keras_dist._values._variables import SyncOnReadVariable


class VariableState:
    """The variables a strategy created, split by kind, in creation order.

    Held weakly: a cached state must not keep a dropped model's variables
    alive (their death is what changes ``version``).
    """

    def __init__(self, version, mirrored, sync_on_read):
        self.version = version
        self._mirrored = [weakref.ref(v) for v in mirrored]
        self._sync_on_read = [weakref.ref(v) for v in sync_on_read]

    @property
    def mirrored(self) -> list:
        """The live ``MirroredVariable`` s with values."""
        return _live(self._mirrored)

    @property
    def sync_on_read(self) -> list:
        """The live ``SyncOnReadVariable`` s with values."""
        return _live(self._sync_on_read)


def _live(refs) -> list:
    return [v for v in (r() for r in refs) if v is not None]


class VariableRegistry:
    """Creates distributed variables for a strategy and keeps (weak) track of them."""

    def __init__(self, strategy, placement, storage_sharding):
        self._strategy = strategy
        self._placement = placement
        self._storage = storage_sharding  # where mirrored values are stored
        self._refs: list = []
        self.version = 0
        self._state = None
        # Across processes: variables whose first value is still this process's own.
        self._unsynced: list = []

    def create(self, variable, engine_replica=None):
        """Keras's variable-creation hook: distributed class, registry, sharding.

        ``engine_replica`` is the eager replica creating the variable, if any:
        it may name replica 0's variable that this one is a copy of.
        """
        if isinstance(variable, (MirroredVariable, SyncOnReadVariable)):
            return self._storage
        if building_batch_norm() and not variable.trainable:
            # tf.keras keeps batch-norm statistics per replica (ON_READ, MEAN);
            # Keras 3 makes them plain variables. Under a strategy, TF's choice.
            make_per_replica_statistic(variable)
        if variable.synchronization == "none" and self._placement.num_replicas > 1:
            raise ValueError(
                "`NONE` variable synchronization mode is not supported with tf.distribute "
                "strategy (as in TF): a variable of a strategy is kept in step on every "
                "replica. Use synchronization='auto' (or 'on_read' for per-replica values). "
                f"Received: synchronization='none' for {variable.path!r}"
            )
        cls = SyncOnReadVariable if variable.synchronization == "on_read" else MirroredVariable
        set_variable_class(variable, cls)
        variable.attach_to(self._strategy)
        primary = engine_replica.primary_for(variable) if engine_replica is not None else None
        if primary is not None:
            share_variable_state(variable, primary)
            return self._storage
        self._refs.append(weakref.ref(variable, self._forget))
        self.version += 1
        if self._placement.spans_processes:
            variable.awaiting_first_value_sync = True
            self._unsynced.append(weakref.ref(variable))
        return self._storage if cls is MirroredVariable else self._placement.replicated

    def _forget(self, _ref):
        self.version += 1

    def state(self) -> VariableState:
        """The live variables with values, as the compiled engine threads them."""
        if self._unsynced:
            self.sync_initial_values()
        state = self._state
        if state is None or state.version != self.version:
            live = [v for v in (r() for r in self._refs) if v is not None]
            self._refs = [weakref.ref(v, self._forget) for v in live]
            state = VariableState(
                self.version,
                [v for v in live if isinstance(v, MirroredVariable) and v.stored() is not None],
                [v for v in live if isinstance(v, SyncOnReadVariable) and v.stored() is not None],
            )
            self._state = state
        return state

    def sync_initial_values(self) -> None:
        """Gives every process worker 0's first values (TF broadcasts them from the chief)."""
        variables = [v for v in (r() for r in self._unsynced) if v is not None]
        # A variable whose first value Keras has not stored yet waits for the next sync.
        waiting = [v for v in variables if v.stored() is None]
        self._unsynced = [weakref.ref(v) for v in waiting]
        waiting_ids = {id(v) for v in waiting}
        for variable in variables:
            variable.awaiting_first_value_sync = id(variable) in waiting_ids
        mirrored = [
            v for v in variables if isinstance(v, MirroredVariable) and v.stored() is not None
        ]
        sync_on_read = [
            v for v in variables if isinstance(v, SyncOnReadVariable) and v.stored() is not None
        ]
        if not mirrored and not sync_on_read:
            return
        new_mirrored, new_stacked = self._placement.from_replica_0(
            [self._placement.replicate(v.stored()) for v in mirrored],
            [v.stored() for v in sync_on_read],
        )
        for variable, value in zip(mirrored, new_mirrored):
            variable.store(value)
        for variable, value in zip(sync_on_read, new_stacked):
            variable.store(value)
