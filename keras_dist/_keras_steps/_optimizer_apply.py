"""A Keras optimizer's ``apply`` called inside a replica: the tf.distribute pattern.

``merge_call`` gathers every replica's gradients, ``batch_reduce_to(SUM)`` sums
them in one fused reduction, and the optimizer's own ``apply`` then runs once,
in the cross-replica context, on the summed gradients: gradient clipping,
loss scaling and the iteration counter see the aggregated values, once.
"""

import jax

from keras_dist._engine._eager import on_device
from keras_dist._keras import RecordingScope
from keras_dist._keras import current_scope
from keras_dist._keras import optimizer_trainable_variables
from keras_dist._keras import shared_gradients
from keras_dist._reduce_op import ReduceOp


def apply_in_replica_context(replica_context, original_apply, optimizer, grads, variables):
    """Called by the hook in ``_keras._optimizer`` for ``optimizer.apply`` in a replica."""
    grads = shared_gradients(grads)  # (``fit``'s step: the replica's share of the batch)
    if variables is None:
        variables = optimizer_trainable_variables(optimizer)
    variables = list(variables)
    present = [i for i, g in enumerate(grads) if g is not None]
    # ``stateless_apply`` runs ``apply`` inside the replica's StatelessScope. Eager
    # replicas are threads, and the merge runs on the calling thread, outside
    # that scope: it gets the scope's values and hands the updates back to it.
    scope = current_scope() if replica_context.eager_index is not None else None

    def merge_fn(strategy, present_grads, scopes):
        reduced = strategy.extended.batch_reduce_to(
            ReduceOp.SUM, [(g, variables[i]) for g, i in zip(present_grads, present)]
        )
        summed = [None] * len(grads)
        for i, value in zip(present, reduced):
            summed[i] = strategy.extended.unwrap_mirrored(value)

        def apply(_, summed):
            return original_apply(optimizer, summed, variables)

        if scopes is None:
            return strategy.extended.update(variables, apply, args=(summed,))
        return _apply_for_stateless_scopes(strategy, apply, variables, summed, scopes)

    return replica_context.merge_call(merge_fn, args=([grads[i] for i in present], scope))


def _apply_for_stateless_scopes(strategy, apply, variables, summed, scopes):
    scopes = strategy.experimental_local_results(scopes)
    extended = strategy.extended

    # Traced values (a partial batch's compiled step) have no devices to move between.
    def replicate(value):
        return value if isinstance(value, jax.core.Tracer) else extended.placement.replicate(value)

    mapping = {key: replicate(value) for key, value in scopes[0].state_mapping.items()}
    with RecordingScope(mapping) as recording:
        extended.update(variables, apply, args=(summed,))
    for index, replica_scope in enumerate(scopes):
        for variable in recording.assigned.values():
            value = recording.state_mapping[id(variable)]
            if not isinstance(value, jax.core.Tracer):  # eager replicas: each on its device
                value = on_device(value, extended.local_devices[index])
            replica_scope.add_update((variable, value))
