"""Keras optimizers in a replica: ``apply`` becomes the tf.distribute pattern.

``BaseOptimizer.apply`` called inside ``strategy.run`` is handed to the
replica-side implementation given to ``install_optimizer_hook`` (``merge_call``
-> ``batch_reduce_to(SUM)`` -> the optimizer's own ``apply`` once). Keras's
``LossScaleOptimizer`` is made to decide on the summed gradients, as TF's does.
"""

import functools

from keras import ops

from keras_dist._keras._internals import BaseOptimizer
from keras_dist._keras._internals import LossScaleOptimizer
from keras_dist._reduce_op import ReduceOp
from keras_dist._replica_context import running_replica_context

_original_apply = BaseOptimizer.apply


def install_optimizer_hook(apply_in_replica_context) -> None:
    """Routes ``optimizer.apply`` in a replica context to ``apply_in_replica_context``.

    It is called as ``apply_in_replica_context(replica_context, original_apply,
    optimizer, grads, trainable_variables)``.
    """
    if getattr(BaseOptimizer.apply, "_keras_dist_hook", False):
        return

    @functools.wraps(_original_apply)
    def apply(self, grads, trainable_variables=None):
        replica_context = running_replica_context()
        if replica_context is None:
            return _original_apply(self, grads, trainable_variables)
        return apply_in_replica_context(
            replica_context, _original_apply, self, grads, trainable_variables
        )

    apply._keras_dist_hook = True
    BaseOptimizer.apply = apply
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
        replica_context = running_replica_context()
        if replica_context is None:
            return original(self, optimizer_variables, grads, trainable_variables)

        def merge_fn(strategy, optimizer_variables, grads, trainable_variables):
            extended = strategy.extended
            summed = extended.batch_reduce_to(ReduceOp.SUM, [(g, g) for g in grads])
            grads = [extended.unwrap_mirrored(g) for g in summed]
            optimizer_variables = [extended.one_value(v) for v in optimizer_variables]
            trainable_variables = [extended.one_value(v) for v in trainable_variables]
            new = original(self, optimizer_variables, grads, trainable_variables)
            return extended.for_every_replica(new)

        return replica_context.merge_call(
            merge_fn, args=(optimizer_variables, grads, trainable_variables)
        )

    return stateless_apply
