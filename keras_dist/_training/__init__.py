"""Training under a strategy: Keras's ``fit`` steps, custom-loop gradients, optimizer apply.

``KERAS_INTEGRATION`` is what the trainer hooks in ``_keras`` call; it is
handed to them when keras_dist installs its hooks.
"""

from keras_dist import _config
from keras_dist._input import Prefetch
from keras_dist._training._optimizer_apply import (
    apply_in_replica_context as apply_in_replica_context,
)
from keras_dist._training._steps import DistributedSteps as DistributedSteps
from keras_dist._training._steps import check_fit_context as check_fit_context
from keras_dist._training._steps import model_strategy as model_strategy
from keras_dist._training._value_and_grad import value_and_grad as value_and_grad


class _KerasIntegration:
    """The training package as the trainer hooks see it (``_keras.TrainingIntegration``)."""

    model_strategy = staticmethod(model_strategy)
    check_fit_context = staticmethod(check_fit_context)

    @staticmethod
    def make_steps(model, strategy) -> DistributedSteps:
        return DistributedSteps(model, strategy)

    @staticmethod
    def host_batches(batches, read_ahead: bool):
        size = _config.prefetch_buffer_size()
        if size and read_ahead:
            return Prefetch(batches, buffer_size=size)
        return batches


KERAS_INTEGRATION = _KerasIntegration()
