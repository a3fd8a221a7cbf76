"""Training under a strategy: Keras's ``fit`` steps, custom-loop gradients, optimizer apply.

``KERAS_INTEGRATION`` is what the trainer hooks in ``_keras`` call; it is
handed to them when keras_dist installs its hooks.
"""

import contextlib
import threading

from keras_dist import _context
from keras_dist._capabilities import RemoteScheduling
from keras_dist._input import Prefetch
from keras_dist._input import densify
from keras_dist._keras_steps import _device_ahead
from keras_dist._keras_steps._auto_shard_input import loop_input
from keras_dist._keras_steps._optimizer_apply import (
    apply_in_replica_context as apply_in_replica_context,
)
from keras_dist._keras_steps._steps import DistributedSteps as DistributedSteps
from keras_dist._keras_steps._steps import check_fit_context as check_fit_context
from keras_dist._keras_steps._steps import check_same_batches_on_every_worker
from keras_dist._keras_steps._steps import model_strategy as model_strategy
from keras_dist._keras_steps._steps import steps_run_on
from keras_dist._keras_steps._steps import wait_for_steps
from keras_dist._keras_steps._value_and_grad import value_and_grad as value_and_grad
from keras_dist.config import _switches as _config


class _KerasIntegration:
    """The training package as the trainer hooks see it (``_keras.TrainingIntegration``)."""

    model_strategy = staticmethod(model_strategy)
    check_fit_context = staticmethod(check_fit_context)
    steps_run_on = staticmethod(steps_run_on)
    wait_for_steps = staticmethod(wait_for_steps)
    loop_input = staticmethod(loop_input)

    @staticmethod
    def make_steps(model, strategy):
        extended = strategy.extended
        if isinstance(extended, RemoteScheduling):
            return extended.training_steps(model)  # steps that run in other processes
        return DistributedSteps(model, strategy)

    def __init__(self):
        self._open = threading.local()

    def host_batches(self, batches, read_ahead: bool, in_memory: bool, layout: tuple):
        extended = _context.get_strategy().extended
        check_same_batches_on_every_worker(extended, layout)
        # Dense here already: Keras builds a model by calling it on the first batch.
        batches = map(densify, batches)
        size = _config.prefetch_buffer_size()
        if size and read_ahead and not in_memory:
            batches = Prefetch(batches, buffer_size=size)
            readers = getattr(self._open, "readers", None)
            if readers is not None:
                readers.append(batches)
        if read_ahead and _device_ahead.puts_ahead(extended):
            batches = _device_ahead.batches_ahead(batches, extended)
        return batches

    @contextlib.contextmanager
    def reading(self):
        """Closes the read-ahead threads a loop opened, whatever ends it (an early
        stop, ``steps_per_epoch``, a callback that raises)."""
        outer = getattr(self._open, "readers", None)
        self._open.readers = []
        try:
            yield
        finally:
            readers, self._open.readers = self._open.readers, outer
            for reader in readers:
                reader.close()


KERAS_INTEGRATION = _KerasIntegration()
