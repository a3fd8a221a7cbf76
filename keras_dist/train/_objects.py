"""What a checkpoint can hold, and how each object's variables are read and written.

A ``Checkpoint`` holds Keras models and layers, optimizers, metrics, variables
(plain ones and keras_dist's ``MirroredVariable``/``SyncOnReadVariable``),
lists and dicts of these, and other checkpoints. An object's variables are
matched by position in ``obj.variables`` (as Keras's ``get_weights`` and
``set_weights`` match them), never by name: a model built by the same code
restores, whatever unique names Keras gave its layers in this process.

Distributed variables are saved as their cross-replica value, as TF saves
them: a ``MirroredVariable`` as its one value, a ``SyncOnReadVariable`` as its
aggregate (``sum``/``mean``; ``only_first_replica`` and ``none``: the first
replica's component). Restoring assigns in the cross-replica context, which
follows TF's rules: a ``sum`` variable saved as 7 on two replicas restores as
3.5 and 3.5.

A ``tf.Variable`` (TF tutorials keep their epoch and step counters in one) is
saved as its ``numpy()`` value and restored with its ``assign``. It is recognised
by its type's module and those two methods: TensorFlow is never imported here.
"""

import jax
import keras
import numpy as np

from keras_dist import _context
from keras_dist._keras_steps import model_strategy
from keras_dist._values._variables import DistributedVariable
from keras_dist._values._variables import SyncOnReadVariable
from keras_dist.cluster_resolver._role import ProcessRole

_WITH_VARIABLES = (
    keras.Model,
    keras.layers.Layer,
    keras.optimizers.Optimizer,
    keras.metrics.Metric,
)


def is_leaf(obj) -> bool:
    """Whether ``obj`` holds variables a checkpoint saves (not a container of such objects).

    >>> is_leaf(keras.Variable(1.0)), is_leaf([keras.Variable(1.0)])
    (True, False)
    """
    return isinstance(obj, (keras.Variable, *_WITH_VARIABLES)) or is_variable(obj)


def is_variable(obj) -> bool:
    """Whether ``obj`` is one variable: a Keras one or a ``tf.Variable``."""
    return isinstance(obj, keras.Variable) or _is_tensorflow_variable(obj)


def _is_tensorflow_variable(obj) -> bool:
    module = type(obj).__module__ or ""
    return (
        module.startswith("tensorflow.")
        and callable(getattr(obj, "assign", None))
        and callable(getattr(obj, "numpy", None))
    )


class TensorFlowVariable:
    """A ``tf.Variable`` as a checkpoint reads and writes variables (``path``, ``shape``,
    ``dtype``, ``value``, ``assign``): saved as its ``numpy()`` value, restored by its
    ``assign`` in the cross-replica context, as a Keras variable is."""

    def __init__(self, variable):
        self.variable = variable

    @property
    def path(self) -> str:
        return self.variable.name

    @property
    def shape(self) -> tuple:
        return tuple(self.variable.shape)

    @property
    def dtype(self) -> str:
        return self.variable.dtype.name

    @property
    def value(self) -> np.ndarray:
        return np.asarray(self.variable.numpy())

    def assign(self, value) -> None:
        self.variable.assign(value)


def describe(obj) -> str:
    """A short name of what ``obj`` is, for error messages."""
    return type(obj).__name__


def variables_of(key: str, obj) -> dict:
    """The variables of a leaf object, by checkpoint key (``<key>`` or ``<key>/<i>``).

    >>> list(variables_of("step", keras.Variable(0)))
    ['step']
    """
    if isinstance(obj, keras.Variable):
        return {key: obj}
    if _is_tensorflow_variable(obj):
        return {key: TensorFlowVariable(obj)}
    return {f"{key}/{i}": variable for i, variable in enumerate(obj.variables)}


def host_value(variable) -> np.ndarray:
    """The value a checkpoint keeps for ``variable``, as a NumPy array.

    Called in the cross-replica context. Reading a distributed variable may be a
    collective across processes, so every process saves (and reads) the same
    variables in the same order.
    """
    if isinstance(variable, SyncOnReadVariable) and variable.aggregation == "none":
        value = variable.local_components()[0]
    else:
        value = variable.value
    if isinstance(value, jax.Array) and not value.is_fully_addressable:
        # Replicated on a mesh across processes: every process holds all of it.
        value = value.addressable_data(0)
    return np.asarray(value)


def as_int(value) -> int:
    """A step counter (a variable, an array or an int) as a Python int.

    >>> as_int(keras.Variable(7))
    7
    """
    if isinstance(value, keras.Variable):
        return int(host_value(value))
    return int(np.asarray(value))


def assign(variable, value: np.ndarray) -> None:
    """Restores ``variable`` from a saved value (cross-replica context)."""
    variable.assign(value)


def strategy_of(variables):
    """The strategy whose scope created the first distributed variable, else the current one."""
    for variable in variables:
        if isinstance(variable, DistributedVariable):
            return variable.distribute_strategy
    return _context.get_strategy()


def process_role(variables) -> ProcessRole:
    """Who this process is, for the strategy the checkpoint's variables belong to.

    Only the chief writes at the user's path (TF's rule). Tests replace this
    function (through the module) to play a non-chief.
    """
    return strategy_of(variables).extended.role


def wait_for_every_process(variables) -> None:
    """Returns once every process got here (after the chief wrote, everyone can read)."""
    strategy_of(variables).extended.barrier("keras_dist.train.checkpoint_written")


def build_optimizer(optimizer, model) -> None:
    """Creates an unbuilt optimizer's slots for ``model`` so saved slots have a place.

    The slots are created in the strategy the model (or optimizer) belongs to, so
    under a ``MirroredStrategy`` they are mirrored, as when training builds them.
    """
    strategy = model_strategy(model)
    if strategy is None and isinstance(optimizer.iterations, DistributedVariable):
        strategy = optimizer.iterations.distribute_strategy
    if strategy is None:
        optimizer.build(model.trainable_variables)
        return
    with strategy.scope():
        optimizer.build(model.trainable_variables)


def is_unbuilt_optimizer(obj) -> bool:
    """Whether ``obj`` is a Keras optimizer whose slots do not exist yet."""
    return isinstance(obj, keras.optimizers.Optimizer) and not obj.built


def is_model(obj) -> bool:
    """Whether ``obj`` is a Keras model (what an unbuilt optimizer is built for)."""
    return isinstance(obj, keras.Model)
