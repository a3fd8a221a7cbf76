"""Variable creation under a strategy: Keras asks the distribution for a layout.

Keras calls ``Distribution.get_variable_layout`` when it creates a variable
(``JaxVariable._initialize_layout``). ``StrategyDistribution`` answers with the
strategy's variable policy (``extended.create_variable``), which gives the
variable its distributed class and returns the sharding it is stored with.
Keras skips the question when a layout was passed in, as optimizers do for
their slots (``add_variable_from_reference`` copies the model variable's
layout), so ``install_variable_hook`` makes Keras ask in that case too.
"""

import functools

from keras_dist import _context
from keras_dist._keras._internals import Distribution
from keras_dist._keras._internals import JaxVariable

# Keras's own methods, before the hook replaces them.
_original_initialize_layout = JaxVariable._initialize_layout
_original_init = JaxVariable.__init__


class StrategyDistribution(Distribution):
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
        return self._strategy.extended.create_variable(variable)

    def get_data_layout(self, data_shape):
        return None

    def get_tensor_layout(self, path):
        return None

    def distribute_dataset(self, dataset):
        return dataset


def is_strategy_distribution(distribution) -> bool:
    """Whether ``distribution`` is one a keras_dist strategy installed."""
    return isinstance(distribution, StrategyDistribution)


def install_variable_hook() -> None:
    """Sends every variable created under a strategy through its policy.

    A variable that the policy marks as another replica's copy of replica 0's
    variable (eager replicas each run the creating code) shares replica 0's
    state once Keras has finished constructing it: both objects then are the
    same variable.
    """
    if getattr(JaxVariable._initialize_layout, "keras_dist_hook", False):
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
        distribution = _context.keras_distribution()
        if isinstance(distribution, StrategyDistribution):
            self._layout = distribution.get_variable_layout(self)
        else:
            _original_initialize_layout(self)

    _initialize_layout.keras_dist_hook = True
    JaxVariable._initialize_layout = _initialize_layout


def share_variable_state(variable, primary) -> None:
    """Makes ``variable`` the same variable as ``primary`` once Keras has built it."""
    variable._keras_dist_primary = primary


def same_variable(a, b) -> bool:
    """Whether two Keras variables are handles of one variable (their state is shared)."""
    return a.__dict__ is b.__dict__


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


def make_per_replica_statistic(variable) -> None:
    """Makes a batch-norm statistic per replica, as tf.keras does (ON_READ, MEAN)."""
    variable._synchronization, variable._aggregation = "on_read", "mean"


def variable_has_value(variable) -> bool:
    """Whether Keras has stored the variable's first value."""
    # A variable whose ``_value`` is a read of its replicas' components (SyncOnRead)
    # says so without reading them.
    holds_value = getattr(variable, "holds_value", None)
    if holds_value is not None:
        return holds_value
    return getattr(variable, "_value", None) is not None
