"""Every private Keras symbol keras_dist touches, imported here and checked at import.

Keras 3 has no public hooks for most of what a tf.distribute strategy needs
(running its own train step per replica, threading variables through a
compiled program, routing ``optimizer.apply`` through ``merge_call``). The
hooks in this package use the symbols listed in ``SYMBOLS``; ``check()`` runs
when keras_dist is imported and verifies that each one is still there, with
the parameters the hook relies on. A Keras release that moves one makes
``import keras_dist`` fail with a message naming the symbol and the supported
versions, instead of a crash deep inside ``fit``.

>>> check()  # the installed Keras has every symbol
"""

import inspect
from typing import NamedTuple

import keras
from keras.src.backend.common import global_state
from keras.src.backend.common import stateless_scope
from keras.src.backend.common import variables as common_variables
from keras.src.backend.common.stateless_scope import StatelessScope
from keras.src.backend.common.stateless_scope import get_stateless_scope
from keras.src.backend.jax import optimizer as jax_optimizer
from keras.src.backend.jax import trainer as jax_trainer
from keras.src.backend.jax.core import JaxVariable
from keras.src.distribution import distribution_lib
from keras.src.layers.layer import Layer
from keras.src.layers.normalization import batch_normalization
from keras.src.losses import loss as loss_module
from keras.src.optimizers import base_optimizer
from keras.src.optimizers import loss_scale_optimizer
from keras.src.random import seed_generator
from keras.src.saving import saving_lib
from keras.src.trainers import data_adapters
from keras.src.trainers import trainer as base_trainer
from keras.src.trainers.data_adapters import data_adapter
from keras.src.trainers.data_adapters import data_adapter_utils
from keras.src.utils import python_utils

SUPPORTED_KERAS = ">=3.15,<3.16"

KerasVariable = common_variables.Variable
JAXTrainer = jax_trainer.JAXTrainer
jax_trainer_module = jax_trainer
JAXEpochIterator = jax_trainer.JAXEpochIterator
Trainer = base_trainer.Trainer
BaseOptimizer = base_optimizer.BaseOptimizer
JaxOptimizer = jax_optimizer.JaxOptimizer
LossScaleOptimizer = loss_scale_optimizer.LossScaleOptimizer
BatchNormalization = batch_normalization.BatchNormalization
SeedGenerator = seed_generator.SeedGenerator
ModelCheckpoint = keras.callbacks.ModelCheckpoint
CallbackList = keras.callbacks.CallbackList
History = keras.callbacks.History
ProgbarLogger = keras.callbacks.ProgbarLogger
is_default = python_utils.is_default
Distribution = distribution_lib.Distribution
initialize_all_variables = common_variables.initialize_all_variables
unpack_x_y_sample_weight = data_adapter_utils.unpack_x_y_sample_weight
DataAdapter = data_adapter.DataAdapter
get_data_adapter = data_adapters.get_data_adapter

__all__ = [
    "BaseOptimizer",
    "BatchNormalization",
    "SeedGenerator",
    "CallbackList",
    "DataAdapter",
    "Distribution",
    "History",
    "JAXEpochIterator",
    "JAXTrainer",
    "JaxOptimizer",
    "JaxVariable",
    "KerasVariable",
    "LossScaleOptimizer",
    "ModelCheckpoint",
    "ProgbarLogger",
    "StatelessScope",
    "Trainer",
    "check",
    "check_attribute",
    "check_symbol",
    "get_data_adapter",
    "get_stateless_scope",
    "global_state",
    "initialize_all_variables",
    "is_default",
    "jax_trainer_module",
    "loss_module",
    "saving_lib",
    "unpack_x_y_sample_weight",
]


class Symbol(NamedTuple):
    """A private Keras symbol: where it lives, and the first parameters we rely on.

    ``parameters`` is ``None`` for attributes that are not called.
    """

    owner: object
    name: str
    parameters: "tuple | None" = None

    @property
    def qualname(self) -> str:
        owner = getattr(self.owner, "__qualname__", getattr(self.owner, "__name__", self.owner))
        return f"{getattr(self.owner, '__module__', '')}.{owner}.{self.name}".lstrip(".")


_LOOP = ("self",)
SYMBOLS = (
    # A replica without rows has a loss of 0 (``_layers.py``).
    Symbol(Trainer, "_compute_loss", ("self", "x", "y", "y_pred", "sample_weight", "training")),
    # Random layers: each replica folds its id into the seeds it draws.
    Symbol(SeedGenerator, "next", ("self", "ordered")),
    # The trainer: loops run in the strategy's scope, steps are ours.
    *(Symbol(JAXTrainer, loop, _LOOP) for loop in ("fit", "evaluate", "predict")),
    *(Symbol(JAXTrainer, f"{kind}_on_batch", _LOOP) for kind in ("train", "test", "predict")),
    *(
        Symbol(JAXTrainer, f"make_{kind}_function", ("self", "force"))
        for kind in ("train", "test", "predict")
    ),
    Symbol(JAXTrainer, "_get_jax_state", ("self",)),
    Symbol(JAXTrainer, "train_step", ("self", "state", "data")),
    Symbol(JAXTrainer, "test_step", ("self", "state", "data")),
    Symbol(JAXTrainer, "predict_step", ("self", "state", "data")),
    Symbol(
        JAXTrainer,
        "_update_metrics_variables",
        ("self", "metrics_variables", "unscaled_loss", "x", "y", "y_pred", "sample_weight"),
    ),
    Symbol(
        JAXTrainer,
        "compute_loss_and_updates",
        ("self", "trainable_variables", "non_trainable_variables", "metrics_variables", "x"),
    ),
    Symbol(jax_trainer, "_distribute_data", ("data", "layouts")),
    Symbol(JAXEpochIterator, "_get_iterator", ("self",)),
    Symbol(JAXEpochIterator, "_enumerate_iterator", ("self",)),
    Symbol(Trainer, "get_metrics_result", ("self",)),
    *(
        Symbol(CallbackList, f"on_{kind}_batch_end", ("self", "batch", "logs"))
        for kind in ("train", "test", "predict")
    ),
    Symbol(Trainer, "compile", ("self",)),
    Symbol(Trainer, "__init__", ("self",)),
    Symbol(data_adapter_utils, "unpack_x_y_sample_weight", ("data",)),
    # fit's input under AutoShardPolicy.OFF: an adapter of ours (Keras takes one as x).
    Symbol(DataAdapter, "get_numpy_iterator", ("self",)),
    Symbol(DataAdapter, "get_jax_iterator", ("self",)),
    Symbol(data_adapters, "get_data_adapter", ("x",)),
    # Which callbacks run code between two steps.
    Symbol(python_utils, "is_default", ("method",)),
    # State threading.
    Symbol(StatelessScope, "__init__", ("self", "state_mapping", "collect_losses")),
    Symbol(StatelessScope, "add_update", ("self", "update")),
    Symbol(StatelessScope, "get_current_value", ("self", "variable")),
    Symbol(stateless_scope, "get_stateless_scope", ()),
    Symbol(global_state, "get_global_attribute", ("name",)),
    Symbol(global_state, "set_global_attribute", ("name", "value")),
    Symbol(common_variables, "initialize_all_variables", ()),
    # Variables: creation hook, storage, class swap.
    Symbol(JaxVariable, "__init__", ("self",)),
    Symbol(JaxVariable, "_initialize_layout", ("self",)),
    Symbol(JaxVariable, "_direct_assign", ("self", "value")),
    Symbol(KerasVariable, "_maybe_autocast", ("self", "value")),
    Symbol(KerasVariable, "_convert_to_tensor", ("self", "value", "dtype")),
    Symbol(Distribution, "get_variable_layout", ("self", "variable")),
    Symbol(BaseOptimizer, "add_variable_from_reference", ("self", "reference_variable")),
    # Optimizers.
    Symbol(BaseOptimizer, "apply", ("self", "grads", "trainable_variables")),
    Symbol(BaseOptimizer, "stateless_apply", ("self", "optimizer_variables", "grads")),
    Symbol(BaseOptimizer, "scale_loss", ("self", "loss")),
    # Updates applied on parameter servers: the update split from the clipping.
    Symbol(JaxOptimizer, "_backend_apply_gradients", ("self", "grads", "trainable_variables")),
    Symbol(BaseOptimizer, "_clip_gradients", ("self", "grads")),
    Symbol(BaseOptimizer, "_apply_weight_decay", ("self", "variables")),
    Symbol(
        BaseOptimizer,
        "_backend_update_step",
        ("self", "grads", "trainable_variables", "learning_rate"),
    ),
    Symbol(LossScaleOptimizer, "check_finite", ("self", "grads")),
    Symbol(LossScaleOptimizer, "_common_apply", ("self", "grads", "trainable_variables")),
    Symbol(LossScaleOptimizer, "_stateful_handle_non_finite_grads", ("self",)),
    Symbol(BaseOptimizer, "_overwrite_variable_with_gradient", ("self", "variable")),
    Symbol(
        LossScaleOptimizer,
        "stateless_apply",
        ("self", "optimizer_variables", "grads", "trainable_variables"),
    ),
    # Layers and losses.
    Symbol(BatchNormalization, "build", ("self", "input_shape")),
    Symbol(BatchNormalization, "_moments", ("self", "inputs", "mask")),
    Symbol(loss_module, "reduce_values", ("values", "sample_weight", "reduction")),
    Symbol(loss_module, "scale_loss_for_distribution", ("value",)),
    Symbol(loss_module, "unscale_loss_for_distribution", ("value",)),
    # Saving: ModelCheckpoint writes at the chief's path, atomically.
    Symbol(saving_lib, "get_attr_skipset", ("obj_type",)),
    Symbol(ModelCheckpoint, "_get_file_path", ("self", "epoch", "batch", "logs")),
    Symbol(ModelCheckpoint, "_save_model", ("self", "epoch", "batch", "logs")),
    # A resumed ModelCheckpoint counts batches by its rule (``_callbacks.py``).
    Symbol(ModelCheckpoint, "_should_save_on_batch", ("self", "batch")),
)

# Instance attributes the hooks read or write: (class, method that sets it, name).
# Checked in the method's source, so that no Keras object is built at import.
ATTRIBUTES = (
    (KerasVariable, "__init__", "_value"),
    (KerasVariable, "__init__", "_layout"),
    (KerasVariable, "__init__", "_synchronization"),
    (KerasVariable, "__init__", "_aggregation"),
    (KerasVariable, "__init__", "_dtype"),
    (KerasVariable, "__init__", "_shape"),
    (BaseOptimizer, "build", "_trainable_variables"),
    (Trainer, "__init__", "_initial_epoch"),
    (BatchNormalization, "build", "_reduction_axes"),
    # BackupAndRestore gives a resumed ModelCheckpoint its count of batches.
    (ModelCheckpoint, "__init__", "_batches_seen_since_last_saving"),
    (ModelCheckpoint, "__init__", "_last_batch_seen"),
)
METHODS = ((Layer, "_flatten_layers"),)


class KerasVersionError(ImportError):
    """The installed Keras lacks an internal that keras_dist relies on."""


def _fail(what: str, detail: str):
    raise KerasVersionError(
        f"keras_dist relies on the Keras internal `{what}`, which {detail} in the "
        f"installed Keras {keras.__version__}. keras_dist supports Keras {SUPPORTED_KERAS}: "
        f"install one with `pip install 'keras{SUPPORTED_KERAS}'`. Received: "
        f"keras=={keras.__version__}"
    )


def _original(fn):
    """The function a keras_dist hook wraps, so a second check sees Keras's own."""
    return getattr(fn, "__wrapped__", fn)


def check_symbol(symbol: Symbol) -> None:
    """Raises ``KerasVersionError`` when ``symbol`` is missing or its parameters changed."""
    if not hasattr(symbol.owner, symbol.name):
        _fail(symbol.qualname, "does not exist")
    if symbol.parameters is None:
        return
    target = _original(getattr(symbol.owner, symbol.name))
    try:
        names = tuple(inspect.signature(target).parameters)
    except (TypeError, ValueError):
        _fail(symbol.qualname, "is no longer a Python function")
    if names[: len(symbol.parameters)] != symbol.parameters:
        _fail(
            symbol.qualname,
            f"takes the parameters {names} instead of starting with {symbol.parameters}",
        )


def check_attribute(owner, method: str, name: str) -> None:
    """Raises ``KerasVersionError`` when ``owner.method`` no longer sets ``self.<name>``."""
    qualname = f"{owner.__module__}.{owner.__qualname__}.{name}"
    try:
        source = inspect.getsource(_original(getattr(owner, method)))
    except (AttributeError, OSError, TypeError):
        _fail(qualname, f"cannot be found (no `{owner.__qualname__}.{method}` source)")
    if f"self.{name}" not in source:
        _fail(qualname, f"is no longer set by `{owner.__qualname__}.{method}`")


def check() -> None:
    """Checks every symbol in ``SYMBOLS`` (run when keras_dist is imported)."""
    for symbol in SYMBOLS:
        check_symbol(symbol)
    for owner, name in METHODS:
        check_symbol(Symbol(owner, name, ("self",)))
    for owner, method, name in ATTRIBUTES:
        check_attribute(owner, method, name)
