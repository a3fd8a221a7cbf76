"""Keras model internals the training steps use: Keras's own step, taken apart.

``fit`` under a strategy runs Keras's JAX ``train_step`` per replica; for a
batch that does not split evenly it runs the pieces of that step instead
(``compute_loss_and_updates``, the metric update). These functions name the
Keras internals those pieces are.
"""

from keras_dist._keras._internals import JAXTrainer
from keras_dist._keras._internals import unpack_x_y_sample_weight

__all__ = [
    "compute_loss_and_updates",
    "keras_update_metrics",
    "model_layers",
    "optimizer_trainable_variables",
    "overrides_keras_step",
    "set_initial_epoch",
    "unpack_x_y_sample_weight",
]


def compute_loss_and_updates(model, *args, **kwargs):
    """Keras's JAX loss and state updates for one batch (``compute_loss_and_updates``)."""
    return model.compute_loss_and_updates(*args, **kwargs)


def keras_update_metrics(model, metrics, unscaled_loss, x, y, y_pred, sample_weight):
    """Keras's JAX metric update for one batch (``JAXTrainer._update_metrics_variables``)."""
    return model._update_metrics_variables(metrics, unscaled_loss, x, y, y_pred, sample_weight)


def overrides_keras_step(model) -> bool:
    """Whether the model's class replaces Keras's JAX ``train_step`` or ``test_step``."""
    return overrides_step(model, "train") or overrides_step(model, "test")


def overrides_step(model, kind: str) -> bool:
    """Whether the model's class replaces Keras's JAX ``{kind}_step`` (``"train"``, ``"test"``)."""
    name = f"{kind}_step"
    return getattr(type(model), name) is not getattr(JAXTrainer, name)


def model_layers(model) -> list:
    """Every layer of ``model``, nested ones included."""
    return list(model._flatten_layers())


def optimizer_trainable_variables(optimizer) -> list:
    """The variables ``optimizer`` was built for (``apply``'s default)."""
    return optimizer._trainable_variables


def set_initial_epoch(model, epoch) -> None:
    """The epoch ``fit`` starts at, as ``BackupAndRestore`` sets it (``None``: from ``fit``)."""
    model._initial_epoch = epoch


def step_state(model, step: str) -> tuple:
    """The state tuple Keras's stateless ``train_step``/``test_step``/``predict_step`` take.

    Each entry is a list of the variables' current values: trainable and
    non-trainable, then the optimizer's (train only) and the metrics' (not
    predict), in Keras's order.
    """
    return tuple([v.value for v in variables] for variables in step_variables(model, step))


def step_variables(model, step: str) -> tuple:
    """The variables of ``step_state``'s entries, in its order."""
    groups = [model.trainable_variables, model.non_trainable_variables]
    if step == "train":
        groups.append(model.optimizer.variables)
    if step in ("train", "test"):
        groups.append(model.metrics_variables)
    return tuple(groups)
