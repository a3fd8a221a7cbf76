"""Keras optimizers in a replica: ``apply`` becomes the tf.distribute pattern.

``BaseOptimizer.apply`` called inside ``strategy.run`` is handed to the
replica-side implementation given to ``install_optimizer_hook`` (``merge_call``
-> ``batch_reduce_to(SUM)`` -> the optimizer's own ``apply`` once). Keras's
``LossScaleOptimizer`` is made to decide on the summed gradients, as TF's does.

Inside ``fit``'s replica step of a custom ``train_step`` (which may never call
``scale_loss``), the gradients an optimizer is handed are first multiplied by
the replica's share of the global batch (``gradient_share``), so that their sum
is the global batch's gradient.

Parameter servers apply updates where the variables live: ``routing_gradients``
lets a trace take an optimizer's clipped gradients instead of updating here,
and ``apply_update`` is the update itself, run later on the ps task. Slots are
made beside their variable (``slot_reference`` says which one).
"""

import functools
import threading

import jax
from keras import ops

from keras_dist._capabilities import MeshRuntime
from keras_dist._context import has_strategy
from keras_dist._context import running_replica_context
from keras_dist._keras._internals import BaseOptimizer
from keras_dist._keras._internals import JaxOptimizer
from keras_dist._keras._internals import LossScaleOptimizer
from keras_dist._reduce_op import ReduceOp
from keras_dist._thread_state import set_for_block

_original_apply = BaseOptimizer.apply
_original_backend_apply = JaxOptimizer._backend_apply_gradients
_original_add_from_reference = BaseOptimizer.add_variable_from_reference


class _Routing(threading.local):
    def __init__(self):
        self.handler = None  # takes an optimizer's gradients instead of updating here
        self.reference = None  # the variable whose slot is being made
        self.unbuilt = None  # told of an optimizer about to build itself in an apply


_routing = _Routing()


class _GradientShare(threading.local):
    def __init__(self):
        self.value = None  # this replica's share of the global batch, inside fit's step


_share = _GradientShare()


def gradient_share(share: float):
    """Multiplies the gradients optimizers get in this thread's replica by ``share``.

    ``fit``'s replica step of a custom ``train_step`` sets it to the replica's
    rows over the global batch's (as TF's losses divide by the global batch):
    the sum over replicas is then the gradient of the global batch's mean loss.

    >>> import numpy as np
    >>> with gradient_share(0.25):
    ...     shared_gradients([np.float32(8.0), None])
    [np.float32(2.0), None]
    >>> shared_gradients([np.float32(8.0)])
    [np.float32(8.0)]
    """
    return set_for_block(_share, "value", share)


def shared_gradients(grads) -> list:
    """``grads`` times this replica's ``gradient_share`` (as they are when none is set)."""
    share = _share.value
    if share is None or share == 1:
        return list(grads)
    return [None if g is None else g * share for g in grads]


def install_optimizer_hook(apply_in_replica_context) -> None:
    """Routes ``optimizer.apply`` in a replica context to ``apply_in_replica_context``.

    It is called as ``apply_in_replica_context(replica_context, original_apply,
    optimizer, grads, trainable_variables)``.
    """
    if getattr(BaseOptimizer.apply, "_keras_dist_hook", False):
        return

    @functools.wraps(_original_apply)
    def apply(self, grads, trainable_variables=None):
        _tell_if_unbuilt(self, trainable_variables)
        replica_context = running_replica_context()
        if replica_context is None:
            return _original_apply(self, grads, trainable_variables)
        return apply_in_replica_context(
            replica_context, _original_apply, self, grads, trainable_variables
        )

    apply._keras_dist_hook = True
    BaseOptimizer.apply = apply
    _install_loss_scale_hook()
    _install_gradient_routing()


def _install_gradient_routing() -> None:
    @functools.wraps(_original_backend_apply)
    def _backend_apply_gradients(self, grads, trainable_variables):
        handler = _routing.handler
        if handler is not None and handler(self, list(grads), list(trainable_variables)):
            return None
        return _original_backend_apply(self, grads, trainable_variables)

    @functools.wraps(_original_add_from_reference)
    def add_variable_from_reference(self, reference_variable, *args, **kwargs):
        # A slot goes to its variable's strategy, as TF's slots do, even when the
        # optimizer is built outside the scope (``optimizer.build(vars)`` after it).
        strategy = getattr(reference_variable, "distribute_strategy", None)
        scope = strategy.scope() if strategy is not None and not has_strategy() else None
        with set_for_block(_routing, "reference", reference_variable):
            if scope is None:
                return _original_add_from_reference(self, reference_variable, *args, **kwargs)
            with scope:
                return _original_add_from_reference(self, reference_variable, *args, **kwargs)

    JaxOptimizer._backend_apply_gradients = _backend_apply_gradients
    BaseOptimizer.add_variable_from_reference = add_variable_from_reference


def routing_gradients(handler):
    """Offers every optimizer update on this thread to ``handler`` first.

    ``handler(optimizer, grads, variables)`` returns True when it took the
    gradients: the optimizer then updates nothing here (its iteration counter
    still counts the step). It returns False to let the update run as usual.
    """
    return set_for_block(_routing, "handler", handler)


def _tell_if_unbuilt(optimizer, trainable_variables) -> None:
    if not optimizer.built and _routing.unbuilt is not None and trainable_variables is not None:
        _routing.unbuilt(optimizer, list(trainable_variables))


def _telling_if_unbuilt(original):
    @functools.wraps(original)
    def apply(self, grads, trainable_variables=None):
        _tell_if_unbuilt(self, trainable_variables)
        return original(self, grads, trainable_variables)

    return apply


def on_unbuilt_apply(callback):
    """Within, an optimizer about to build itself in ``apply`` (its first) calls
    ``callback(optimizer, variables)`` first: a parameter-server program's trace
    stops there, so that its slots are made on the ps tasks, outside the trace."""
    return set_for_block(_routing, "unbuilt", callback)


def slot_reference():
    """The variable an optimizer is making a slot for on this thread, or ``None``."""
    return _routing.reference


def clip_gradients(optimizer, grads) -> list:
    """``grads`` clipped as ``optimizer`` clips them (``clipnorm``, ``global_clipnorm``...)."""
    return optimizer._clip_gradients(grads)


def apply_update(optimizer, grads, variables) -> None:
    """``optimizer``'s update of ``variables`` from clipped ``grads`` (weight decay, step)."""
    optimizer._apply_weight_decay(variables)
    optimizer._backend_update_step(grads, variables, optimizer.learning_rate)


def _install_loss_scale_hook() -> None:
    """Makes ``LossScaleOptimizer``'s finite-gradient test agree across replicas.

    Keras's ``LossScaleOptimizer.stateless_apply`` tests the replica's own
    gradients, then branches (``ops.cond``) into a branch that calls the inner
    optimizer's ``apply`` (a ``merge_call`` with collectives) or one that only
    halves the scale. When one replica overflowed and another did not, the
    replicas took different branches and the collectives never met (XLA aborts
    the process). TF tests the summed gradients; a gradient sum is finite when
    every replica's is, so the replicas combine their verdicts.
    """
    original = LossScaleOptimizer.check_finite
    if getattr(original, "_keras_dist_hook", False):
        return

    @functools.wraps(original)
    def check_finite(self, grads):
        finite = original(self, grads)
        replica_context = running_replica_context()
        if replica_context is None:
            return finite
        non_finite = ops.cast(ops.logical_not(finite), "float32")
        return ops.equal(replica_context.all_reduce(ReduceOp.SUM, non_finite), 0)

    check_finite._keras_dist_hook = True
    LossScaleOptimizer.check_finite = check_finite
    LossScaleOptimizer.apply = _telling_if_unbuilt(LossScaleOptimizer.apply)  # (its own apply)
    LossScaleOptimizer.stateless_apply = _merged_stateless_apply(LossScaleOptimizer.stateless_apply)
    LossScaleOptimizer._common_apply = _apply_through_stateless(LossScaleOptimizer._common_apply)


def _apply_through_stateless(original):
    """``LossScaleOptimizer.apply`` on JAX, without side effects inside ``ops.cond``.

    Keras's own stateful ``apply`` branches with ``ops.cond`` into branches that
    assign variables; JAX traces both branches, so the assignments store tracers
    and it fails even on one device, in eager code (``UnexpectedTracerError``).
    TF's mixed-precision custom loop calls it, so:

    - with concrete gradients (eager code), the branches are taken in Python,
      the inner optimizer's ``apply`` included (its sparse updates stay sparse);
    - inside a trace (``strategy.run``, ``kd.function``), as Keras's ``fit`` does
      it: ``stateless_apply`` on the variables' values, and the new values written
      back (in a replica, ``stateless_apply`` sums the gradients first).
    """

    @functools.wraps(original)
    def _common_apply(self, grads, trainable_variables=None):
        grads = list(grads)
        variables = list(trainable_variables or self._trainable_variables)
        finite = self.check_finite(grads)
        if isinstance(finite, jax.core.Tracer):
            new_trainable, new_optimizer = self.stateless_apply(
                [v.value for v in self.variables], grads, [v.value for v in variables]
            )
            # Through the optimizer's own ``assign``, as Keras's optimizers write.
            for variable, value in zip(variables, new_trainable):
                self.assign(variable, value)
            for variable, value in zip(self.variables, new_optimizer):
                self.assign(variable, value)
        elif not bool(finite):
            self._stateful_handle_non_finite_grads()
        else:
            scale = self.dynamic_scale
            unscaled = [
                g
                if g is None or self._overwrite_variable_with_gradient(v)
                else ops.divide(g, scale)
                for g, v in zip(grads, variables)
            ]
            self.inner_optimizer.apply(unscaled, trainable_variables=trainable_variables)
            if int(self.step_counter.numpy()) == self.dynamic_growth_steps - 1:
                self.step_counter.assign(0)
                self.dynamic_scale.assign(ops.multiply(self.dynamic_scale, 2.0))
            else:
                self.step_counter.assign_add(1)

    return _common_apply


def _merged_stateless_apply(original):
    """``LossScaleOptimizer.stateless_apply`` in a replica: sum first, then decide, as TF.

    TF's loss-scale optimizer reduces the gradients in a ``merge_call`` and runs
    its finite test and update once, in the cross-replica context. Keras's tests
    and branches (``ops.cond``) per replica, with the inner optimizer's
    ``merge_call`` inside a traced branch, which eager replicas cannot share.
    """

    @functools.wraps(original)
    def stateless_apply(self, optimizer_variables, grads, trainable_variables):
        replica_context = running_replica_context()
        if replica_context is None:
            return original(self, optimizer_variables, grads, trainable_variables)

        grads = shared_gradients(grads)

        def merge_fn(strategy, optimizer_variables, grads, trainable_variables):
            extended = strategy.extended
            summed = extended.batch_reduce_to(ReduceOp.SUM, [(g, g) for g in grads])
            grads = [extended.unwrap_mirrored(g) for g in summed]
            if not isinstance(extended, MeshRuntime):  # one replica: values pass through
                return original(self, optimizer_variables, grads, trainable_variables)
            optimizer_variables = [extended.one_value(v) for v in optimizer_variables]
            trainable_variables = [extended.one_value(v) for v in trainable_variables]
            new = original(self, optimizer_variables, grads, trainable_variables)
            return extended.for_every_replica(new)

        return replica_context.merge_call(
            merge_fn, args=(optimizer_variables, grads, trainable_variables)
        )

    return stateless_apply
