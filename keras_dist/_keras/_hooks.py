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
import threading

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
    "building_batch_norm",
    "install_optimizer_hook",
    "install_trainer_hook",
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
        from keras_dist._keras._optimizer import apply_in_replica_context

        replica_context = _context.current_frame().replica_context
        if replica_context is None or replica_context._is_default:
            return _original_apply(self, grads, trainable_variables)
        return apply_in_replica_context(
            replica_context, _original_apply, self, grads, trainable_variables
        )

    apply._keras_dist_hook = True
    base_optimizer.BaseOptimizer.apply = apply
    _install_loss_scale_hook()


def _install_loss_scale_hook() -> None:
    """Makes ``LossScaleOptimizer``'s finite-gradient test agree across replicas.

    Keras's ``LossScaleOptimizer.stateless_apply`` tests the replica's own
    gradients, then branches (``ops.cond``) into a branch that calls the inner
    optimizer's ``apply`` (a ``merge_call`` with collectives) or one that only
    halves the scale. When one replica overflowed and another did not, the
    replicas took different branches and the collectives never met (XLA aborts
    the process). TF tests the summed gradients; a gradient sum is finite when
    every replica's is, so the replicas combine their verdicts.
    Internal used: ``LossScaleOptimizer.check_finite``.
    """
    from keras.src.optimizers.loss_scale_optimizer import LossScaleOptimizer

    original = LossScaleOptimizer.check_finite
    if getattr(original, "_keras_dist_hook", False):
        return

    @functools.wraps(original)
    def check_finite(self, grads):
        from keras.src import ops

        from keras_dist import _context
        from keras_dist._reduce_op import ReduceOp

        finite = original(self, grads)
        replica_context = _context.current_frame().replica_context
        if replica_context is None or replica_context._is_default:
            return finite
        non_finite = ops.cast(ops.logical_not(finite), "float32")
        return ops.equal(replica_context.all_reduce(ReduceOp.SUM, non_finite), 0)

    check_finite._keras_dist_hook = True
    LossScaleOptimizer.check_finite = check_finite
    LossScaleOptimizer.stateless_apply = _merged_stateless_apply(LossScaleOptimizer.stateless_apply)


def _merged_stateless_apply(original):
    """``LossScaleOptimizer.stateless_apply`` in a replica: sum first, then decide, as TF.

    TF's loss-scale optimizer reduces the gradients in a ``merge_call`` and runs
    its finite test and update once, in the cross-replica context. Keras's tests
    and branches (``ops.cond``) per replica, with the inner optimizer's
    ``merge_call`` inside a traced branch, which eager replicas cannot share.
    """

    @functools.wraps(original)
    def stateless_apply(self, optimizer_variables, grads, trainable_variables):
        from keras_dist import _context

        replica_context = _context.current_frame().replica_context
        if replica_context is None or replica_context._is_default:
            return original(self, optimizer_variables, grads, trainable_variables)

        def merge_fn(strategy, optimizer_variables, grads, trainable_variables):
            from keras_dist._reduce_op import ReduceOp

            extended = strategy.extended
            summed = extended.batch_reduce_to(ReduceOp.SUM, [(g, g) for g in grads])
            grads = [extended._unwrap_mirrored(g) for g in summed]
            optimizer_variables = [extended._one_value(v) for v in optimizer_variables]
            trainable_variables = [extended._one_value(v) for v in trainable_variables]
            new = original(self, optimizer_variables, grads, trainable_variables)
            return extended._for_every_replica(new)

        return replica_context.merge_call(
            merge_fn, args=(optimizer_variables, grads, trainable_variables)
        )

    return stateless_apply


# ----------------------------------------------------------------------------
# Trainer: fit / evaluate / predict of a model created under a strategy.
# Keras's JAX loops stay; the step functions, the state handling and the data
# iterator are ours (see ``_fit.py``). Internals used: ``JAXTrainer.make_*_function``
# and ``_get_jax_state``, ``JAXEpochIterator._get_iterator``,
# ``Trainer.get_metrics_result`` and ``Trainer.compile``.


def _strategy_of(model):
    from keras_dist._training._steps import model_strategy

    return model_strategy(model)


def _wrap_loop(original):
    """Runs a Keras loop in the model's strategy scope, so variables it creates are distributed."""

    @functools.wraps(original)
    def loop(self, *args, **kwargs):
        from keras_dist._training._steps import check_fit_context

        strategy = _strategy_of(self)
        if strategy is None:
            check_fit_context(self)
            return original(self, *args, **kwargs)
        if original.__name__ == "fit":
            # Keras shuffles with NumPy's global generator: across processes
            # every worker must draw the same order (it keeps its replicas'
            # pieces of each global batch).
            strategy.extended._agree_on_host_random_state()
        with strategy.scope():
            return original(self, *args, **kwargs)

    loop._keras_dist_hook = True
    return loop


def _steps(model, strategy):
    from keras_dist._training._steps import DistributedSteps

    steps = getattr(model, "_keras_dist_steps", None)
    if steps is None or steps.strategy is not strategy:
        steps = DistributedSteps(model, strategy)
        object.__setattr__(model, "_keras_dist_steps", steps)
    return steps


def _wrap_make_function(original, attribute):
    @functools.wraps(original)
    def make_function(self, force=False):
        strategy = _strategy_of(self)
        if strategy is None:
            return original(self, force)
        if getattr(self, attribute) is None or force:
            setattr(self, attribute, getattr(_steps(self, strategy), attribute))
        return getattr(self, attribute)

    return make_function


def _wrap_get_jax_state(original):
    @functools.wraps(original)
    def get_jax_state(self, **groups):
        if _strategy_of(self) is None:
            return original(self, **groups)
        # Our steps read and write the variables themselves: an empty list per
        # requested group keeps Keras's unpacking and syncing no-ops.
        wanted = ("trainable_variables", "non_trainable_variables")
        wanted += ("optimizer_variables", "metrics_variables")
        return tuple([] for name in wanted if groups.get(name))

    return get_jax_state


def _wrap_get_iterator(original):
    @functools.wraps(original)
    def get_iterator(self):
        if isinstance(distribution_lib.distribution(), StrategyDistribution):
            # Host batches: the strategy splits and places them itself. They are
            # read ahead, except from a generator: Keras may start a new epoch
            # on the same generator, and batches read ahead would be lost.
            from keras_dist._config import prefetch_buffer_size
            from keras_dist._input._prefetch import Prefetch

            batches = self.data_adapter.get_numpy_iterator()
            size = prefetch_buffer_size()
            if size and type(self.data_adapter).__name__ != "GeneratorDataAdapter":
                return Prefetch(batches, buffer_size=size)
            return batches
        return original(self)

    return get_iterator


def _wrap_enumerate_iterator(original):
    """The last execution of an epoch ends at the epoch's last batch, as in tf-keras.

    Keras 3 reports ``begin + steps_per_execution - 1`` to ``on_*_batch_end``
    even when the epoch ends sooner (batch 59 of a 50-batch epoch with
    ``steps_per_execution=20``); tf-keras reports 49.
    """

    @functools.wraps(original)
    def enumerate_iterator(self):
        steps = self.steps_per_epoch or self._num_batches
        for begin_step, end_step, iterator in original(self):
            if steps and isinstance(distribution_lib.distribution(), StrategyDistribution):
                end_step = min(end_step, steps - 1)
            yield begin_step, end_step, iterator

    return enumerate_iterator


def _wrap_get_metrics_result(original):
    @functools.wraps(original)
    def get_metrics_result(self):
        from keras_dist import _context

        frame = _context.current_frame()
        replica_context = frame.replica_context
        if replica_context is not None and getattr(frame.engine, "compiled", False):
            # As tf.keras's metric results: read in a merge_call, aggregated.
            return replica_context.merge_call(lambda _: original(self))
        return original(self)

    return get_metrics_result


def _wrap_compile(original):
    @functools.wraps(original)
    def compile(self, *args, **kwargs):
        from keras_dist import _context
        from keras_dist.strategies._default import is_default_strategy

        strategy = _context.get_strategy()
        if not is_default_strategy(strategy):
            object.__setattr__(self, "_keras_dist_strategy", strategy)
        return original(self, *args, **kwargs)

    return compile


_batch_norm_building = threading.local()


def building_batch_norm() -> bool:
    """Whether variables are being created by ``BatchNormalization.build``."""
    return getattr(_batch_norm_building, "active", False)


def _wrap_batch_norm_build(original):
    @functools.wraps(original)
    def build(self, input_shape):
        _batch_norm_building.active = True
        try:
            return original(self, input_shape)
        finally:
            _batch_norm_building.active = False

    return build


def _wrap_reduce_values(original):
    """An empty batch's loss reduces to 0 under a strategy, as in tf-keras.

    A last batch smaller than the replica count leaves some replicas no rows.
    tf-keras reduces their loss to 0 (``divide_no_nan``); Keras 3's
    ``losses.loss.reduce_values`` returns the empty array itself, which breaks
    the gradient (not a scalar) and turns the loss metric into NaN.
    """

    @functools.wraps(original)
    def reduce_values(values, sample_weight=None, reduction="sum_over_batch_size"):
        shape = tuple(getattr(values, "shape", ()))
        if reduction not in (None, "none") and 0 in shape:
            from keras_dist import _context
            from keras_dist.strategies._default import is_default_strategy

            if not is_default_strategy(_context.get_strategy()):
                from keras.src import ops

                return ops.zeros((), dtype=values.dtype)
        return original(values, sample_weight, reduction)

    return reduce_values


def install_trainer_hook() -> None:
    """Routes the training loops of models created under a strategy through ``_fit``."""
    from keras.src.backend.jax import trainer as jax_trainer
    from keras.src.layers.normalization.batch_normalization import BatchNormalization
    from keras.src.losses import loss as loss_module
    from keras.src.trainers import trainer as base_trainer

    cls = jax_trainer.JAXTrainer
    if getattr(cls.fit, "_keras_dist_hook", False):
        return
    loops = ("fit", "evaluate", "predict", "train_on_batch", "test_on_batch", "predict_on_batch")
    for name in loops:
        setattr(cls, name, _wrap_loop(getattr(cls, name)))
    for name, attribute in (
        ("make_train_function", "train_function"),
        ("make_test_function", "test_function"),
        ("make_predict_function", "predict_function"),
    ):
        setattr(cls, name, _wrap_make_function(getattr(cls, name), attribute))
    cls._get_jax_state = _wrap_get_jax_state(cls._get_jax_state)
    epoch_iterator = jax_trainer.JAXEpochIterator
    epoch_iterator._get_iterator = _wrap_get_iterator(epoch_iterator._get_iterator)
    epoch_iterator._enumerate_iterator = _wrap_enumerate_iterator(
        epoch_iterator._enumerate_iterator
    )
    base_trainer.Trainer.get_metrics_result = _wrap_get_metrics_result(
        base_trainer.Trainer.get_metrics_result
    )
    base_trainer.Trainer.compile = _wrap_compile(base_trainer.Trainer.compile)
    BatchNormalization.build = _wrap_batch_norm_build(BatchNormalization.build)
    loss_module.reduce_values = _wrap_reduce_values(loss_module.reduce_values)
    _install_saving_skipset_cache()


def _install_saving_skipset_cache() -> None:
    """Builds Keras's saving skip-sets once, outside any strategy.

    ``saving_lib.get_attr_skipset`` caches under one key and looks under another
    (Keras 3.15), so every save builds reference objects again, among them an
    ``Optimizer`` whose variables, created under the strategy, would join its
    state and make the next step compile again (and, across processes, take a
    collective to sync). Here each skip-set is built once, with no strategy.
    """
    from keras.src.saving import saving_lib

    original = saving_lib.get_attr_skipset
    if getattr(original, "_keras_dist_hook", False):
        return
    cache: dict = {}

    @functools.wraps(original)
    def get_attr_skipset(obj_type):
        if obj_type not in cache:
            distribution = global_state.get_global_attribute("distribution")
            global_state.set_global_attribute("distribution", None)
            try:
                cache[obj_type] = original(obj_type)
            finally:
                global_state.set_global_attribute("distribution", distribution)
        return cache[obj_type]

    get_attr_skipset._keras_dist_hook = True
    saving_lib.get_attr_skipset = get_attr_skipset


def keras_update_metrics(model, metrics, unscaled_loss, x, y, y_pred, sample_weight):
    """Keras's JAX metric update for one batch (``JAXTrainer._update_metrics_variables``)."""
    return model._update_metrics_variables(metrics, unscaled_loss, x, y, y_pred, sample_weight)


def overrides_keras_step(model) -> bool:
    """Whether the model's class replaces Keras's JAX ``train_step`` or ``test_step``."""
    from keras.src.backend.jax.trainer import JAXTrainer

    cls = type(model)
    return cls.train_step is not JAXTrainer.train_step or cls.test_step is not JAXTrainer.test_step
