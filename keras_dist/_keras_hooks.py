"""Everything in keras_dist that touches Keras internals lives here.

Each hook names the Keras internal it relies on; ``tests/test_keras_hooks.py``
fails loudly when a Keras release moves one of them.

* Variable creation: Keras asks the current ``keras.distribution.Distribution``
  for a layout when a variable is created (``JaxVariable._initialize_layout``).
  Our distribution answers with the strategy's placement and gives the
  variable its distributed class. Keras skips the question when a layout was
  passed in, as optimizers do for their slots (``add_variable_from_reference``
  copies the model variable's layout), so ``install_variable_hook`` makes
  Keras ask our distribution in that case too.
* State threading: ``StatelessScope`` maps variables (by ``id``) to values;
  ``RecordingScope`` also records which variables were assigned or read
  without a mapping.
* Optimizers: ``BaseOptimizer.apply`` called in a replica context becomes
  ``merge_call`` -> ``batch_reduce_to(SUM)`` -> ``update``, as tf.distribute does.
"""

import functools

from keras.src.backend.common import global_state
from keras.src.backend.common.stateless_scope import StatelessScope
from keras.src.backend.common.stateless_scope import get_stateless_scope
from keras.src.backend.common.variables import Variable as KerasVariable
from keras.src.backend.common.variables import initialize_all_variables
from keras.src.backend.jax.core import JaxVariable
from keras.src.distribution import distribution_lib
from keras.src.optimizers import base_optimizer

__all__ = [
    "KerasVariable",
    "RecordingScope",
    "StrategyDistribution",
    "current_mapping",
    "get_stateless_scope",
    "initialize_pending_variables",
    "install_optimizer_hook",
    "install_variable_hook",
    "pending_variables",
]


class StrategyDistribution(distribution_lib.Distribution):
    """The Keras distribution a strategy installs while it is current.

    Keras calls ``get_variable_layout`` for every variable it creates; we hand
    the variable to the strategy, which registers it, gives it its distributed
    class and returns the ``jax.sharding.Sharding`` it should be stored with.
    """

    def __init__(self, strategy):
        # Keras's DeviceMesh is not needed: only the variable hook is used.
        super().__init__(device_mesh=None, auto_shard_dataset=False)
        self._strategy = strategy

    @property
    def num_model_replicas(self):
        return self._strategy.num_replicas_in_sync

    def get_variable_layout(self, variable):
        return self._strategy.extended._create_variable(variable)

    def get_data_layout(self, data_shape):
        return None

    def get_tensor_layout(self, path):
        return None

    def distribute_dataset(self, dataset):
        return dataset


_original_initialize_layout = JaxVariable._initialize_layout
_original_init = JaxVariable.__init__


def install_variable_hook() -> None:
    """Sends every variable created under a strategy through its policy.

    A variable that the policy marks as another replica's copy of replica 0's
    variable (eager replicas each run the creating code) shares replica 0's
    state once Keras has finished constructing it: both objects then are the
    same variable.
    """
    if getattr(JaxVariable._initialize_layout, "_keras_dist_hook", False):
        return

    @functools.wraps(_original_init)
    def __init__(self, *args, **kwargs):
        _original_init(self, *args, **kwargs)
        primary = self.__dict__.pop("_keras_dist_primary", None)
        if primary is not None:
            self.__dict__ = primary.__dict__

    JaxVariable.__init__ = __init__

    @functools.wraps(_original_initialize_layout)
    def _initialize_layout(self):
        distribution = global_state.get_global_attribute("distribution")
        if isinstance(distribution, StrategyDistribution):
            self._layout = distribution.get_variable_layout(self)
        else:
            _original_initialize_layout(self)

    _initialize_layout._keras_dist_hook = True
    JaxVariable._initialize_layout = _initialize_layout


def set_variable_class(variable, cls) -> None:
    """Gives a freshly created Keras variable one of our distributed classes.

    Called from ``get_variable_layout``, before Keras stores the first value,
    so the subclass's storage hooks see that first value.
    """
    if not issubclass(cls, type(variable)):
        raise TypeError(
            f"Cannot make a {cls.__name__} from a {type(variable).__name__}: "
            "keras_dist supports the JAX backend's variables only."
        )
    variable.__class__ = cls


class RecordingScope(StatelessScope):
    """A ``StatelessScope`` that records assigned and unmapped variables.

    ``mapping`` is a dict ``id(variable) -> value``, taken as is (no copies or
    checks: this runs on every trace and every gradient call).
    """

    def __init__(self, mapping: dict, deferred_writes: "list | None" = None):
        super().__init__(initialize_variables=False)
        self.state_mapping = mapping
        self.assigned: dict = {}
        self.unmapped: dict = {}
        # When a list, distributed variables written in a replica append
        # (variable, kind, value) to it instead of aggregating at once.
        self.deferred_writes = deferred_writes

    def add_update(self, update):
        variable, value = update
        self.assigned[id(variable)] = variable
        self.state_mapping[id(variable)] = value

    def get_current_value(self, variable):
        value = self.state_mapping.get(id(variable))
        if value is None:
            self.unmapped[id(variable)] = variable
        return value


def current_mapping() -> dict:
    """The ``id -> value`` mapping of the current stateless scope, if any."""
    scope = get_stateless_scope()
    return dict(scope.state_mapping) if scope is not None else {}


def pending_variables() -> list:
    """Variables created inside a stateless scope and not yet initialized."""
    return list(global_state.get_global_attribute("uninitialized_variables") or [])


def initialize_pending_variables() -> None:
    initialize_all_variables()


_original_apply = base_optimizer.BaseOptimizer.apply


def install_optimizer_hook() -> None:
    """Routes ``optimizer.apply`` in a replica context through ``merge_call``."""
    if getattr(base_optimizer.BaseOptimizer.apply, "_keras_dist_hook", False):
        return

    @functools.wraps(_original_apply)
    def apply(self, grads, trainable_variables=None):
        from keras_dist import _context
        from keras_dist._optimizer import apply_in_replica_context

        replica_context = _context.current_frame().replica_context
        if replica_context is None or replica_context._is_default:
            return _original_apply(self, grads, trainable_variables)
        return apply_in_replica_context(
            replica_context, _original_apply, self, grads, trainable_variables
        )

    apply._keras_dist_hook = True
    base_optimizer.BaseOptimizer.apply = apply
