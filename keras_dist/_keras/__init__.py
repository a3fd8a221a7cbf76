"""Everything in keras_dist that touches Keras internals.

``_internals`` imports every private Keras symbol we use and checks them when
keras_dist is imported; the other modules are the hooks, one concern each:
variables (creation policy), scopes (state threading), optimizer, trainer,
layers, saving, and the pieces of Keras's train step (``_model``).
"""

from keras_dist._keras._callbacks import HoldsResources as HoldsResources
from keras_dist._keras._callbacks import checkpoint_batch_count as checkpoint_batch_count
from keras_dist._keras._callbacks import (
    checkpoint_batch_count_through as checkpoint_batch_count_through,
)
from keras_dist._keras._callbacks import checkpoint_direction as checkpoint_direction
from keras_dist._keras._callbacks import set_checkpoint_batch_count as set_checkpoint_batch_count
from keras_dist._keras._callbacks import set_checkpoint_direction as set_checkpoint_direction
from keras_dist._keras._instance_patches import replaced_methods as replaced_methods
from keras_dist._keras._internals import DataAdapter as DataAdapter
from keras_dist._keras._internals import KerasVariable as KerasVariable
from keras_dist._keras._internals import KerasVersionError as KerasVersionError
from keras_dist._keras._internals import check as check_keras_internals
from keras_dist._keras._internals import get_data_adapter as get_data_adapter
from keras_dist._keras._layers import building_batch_norm as building_batch_norm
from keras_dist._keras._layers import install_layer_hooks
from keras_dist._keras._loss_reductions import global_sample_weights as global_sample_weights
from keras_dist._keras._loss_reductions import install_loss_hooks
from keras_dist._keras._loss_reductions import needs_every_replica as needs_every_replica
from keras_dist._keras._loss_reductions import recording_sample_weights as recording_sample_weights
from keras_dist._keras._loss_reductions import replica_batch_share as replica_batch_share
from keras_dist._keras._model import compute_loss_and_updates as compute_loss_and_updates
from keras_dist._keras._model import keras_update_metrics as keras_update_metrics
from keras_dist._keras._model import model_layers as model_layers
from keras_dist._keras._model import optimizer_trainable_variables as optimizer_trainable_variables
from keras_dist._keras._model import overrides_keras_step as overrides_keras_step
from keras_dist._keras._model import overrides_step as overrides_step
from keras_dist._keras._model import set_initial_epoch as set_initial_epoch
from keras_dist._keras._model import step_state as step_state
from keras_dist._keras._model import step_variables as step_variables
from keras_dist._keras._model import unpack_x_y_sample_weight as unpack_x_y_sample_weight
from keras_dist._keras._optimizer import apply_update as apply_update
from keras_dist._keras._optimizer import clip_gradients as clip_gradients
from keras_dist._keras._optimizer import gradient_share as gradient_share
from keras_dist._keras._optimizer import install_optimizer_hook
from keras_dist._keras._optimizer import on_unbuilt_apply as on_unbuilt_apply
from keras_dist._keras._optimizer import routing_gradients as routing_gradients
from keras_dist._keras._optimizer import shared_gradients as shared_gradients
from keras_dist._keras._optimizer import slot_reference as slot_reference
from keras_dist._keras._saving import install_saving_hook
from keras_dist._keras._scopes import RecordingScope as RecordingScope
from keras_dist._keras._scopes import adopt_pending_variables as adopt_pending_variables
from keras_dist._keras._scopes import current_mapping as current_mapping
from keras_dist._keras._scopes import current_scope as current_scope
from keras_dist._keras._scopes import initialize_pending_variables as initialize_pending_variables
from keras_dist._keras._scopes import move_pending_variables as move_pending_variables
from keras_dist._keras._scopes import pending_variables as pending_variables
from keras_dist._keras._trainer import TrainingIntegration as TrainingIntegration
from keras_dist._keras._trainer import compiled_under as compiled_under
from keras_dist._keras._trainer import execution_batches as execution_batches
from keras_dist._keras._trainer import fit_callbacks as fit_callbacks
from keras_dist._keras._trainer import install_trainer_hook
from keras_dist._keras._trainer import running_loop as running_loop
from keras_dist._keras._variable_hooks import StrategyDistribution as StrategyDistribution
from keras_dist._keras._variable_hooks import install_variable_hook
from keras_dist._keras._variable_hooks import (
    make_per_replica_statistic as make_per_replica_statistic,
)
from keras_dist._keras._variable_hooks import same_variable as same_variable
from keras_dist._keras._variable_hooks import set_variable_class as set_variable_class
from keras_dist._keras._variable_hooks import share_variable_state as share_variable_state
from keras_dist._keras._variable_hooks import variable_has_value as variable_has_value


def install_hooks(
    training: TrainingIntegration, apply_in_replica_context, chief_checkpoint: type
) -> None:
    """Installs every hook (once): variables, optimizer, trainer, layers, losses, saving.

    The arguments come from the packages above this one: the training steps, the
    optimizer's apply in a replica, and the chief-only ``ModelCheckpoint`` class.
    """
    check_keras_internals()
    install_variable_hook()
    install_optimizer_hook(apply_in_replica_context)
    install_trainer_hook(training, chief_checkpoint)
    install_layer_hooks()
    install_loss_hooks()
    install_saving_hook()
