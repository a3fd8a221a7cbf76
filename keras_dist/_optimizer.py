"""A Keras optimizer's ``apply`` called inside a replica: the tf.distribute pattern.

``merge_call`` gathers every replica's gradients, ``batch_reduce_to(SUM)`` sums
them in one fused reduction, and the optimizer's own ``apply`` then runs once,
in the cross-replica context, on the summed gradients: gradient clipping,
loss scaling and the iteration counter see the aggregated values, once.
"""

from keras_dist._reduce_op import ReduceOp


def apply_in_replica_context(replica_context, original_apply, optimizer, grads, variables):
    """Called by the hook in ``_keras_hooks`` for ``optimizer.apply`` in a replica."""
    grads = list(grads)
    if variables is None:
        variables = optimizer._trainable_variables
    variables = list(variables)
    present = [i for i, g in enumerate(grads) if g is not None]

    def merge_fn(strategy, present_grads):
        reduced = strategy.extended.batch_reduce_to(
            ReduceOp.SUM, [(g, variables[i]) for g, i in zip(present_grads, present)]
        )
        summed = [None] * len(grads)
        for i, value in zip(present, reduced):
            summed[i] = strategy.extended._unwrap_mirrored(value)
        return strategy.extended.update(
            variables, lambda _, g: original_apply(optimizer, g, variables), args=(summed,)
        )

    return replica_context.merge_call(merge_fn, args=([grads[i] for i in present],))
