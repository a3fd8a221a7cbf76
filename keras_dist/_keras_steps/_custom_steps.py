"""A replica's step as Keras's own counts it, for a model's own ``train_step``/``test_step``.

Keras's JAX ``train_step`` differentiates ``optimizer.scale_loss(loss)``: the
replica's share of the global batch is added there. A custom step may never
call it, and may return its replica's own metric values as logs; these two
helpers make it count and report as one device's.
"""

import contextlib

import jax

from keras_dist import _context
from keras_dist._keras import gradient_share
from keras_dist._keras import overrides_step
from keras_dist._keras import replaced_methods
from keras_dist._keras import replica_batch_share


@contextlib.contextmanager
def counted_by_share(model, share):
    """Within, the replica's gradients count by ``share`` (its rows of the global batch),
    and its losses reduce as parts of the global batch (``replica_batch_share``).

    Keras's own JAX ``train_step`` differentiates ``optimizer.scale_loss(loss)``
    and reports the unscaled loss: the loss is scaled there, before the
    gradient, as TF's losses divide by the global batch (with float16, smaller
    gradients overflow less). A custom ``train_step`` may never call
    ``scale_loss``: its gradients are scaled as the optimizer receives them.
    """
    optimizer = model.optimizer
    if overrides_step(model, "train"):
        counted = gradient_share(share)
    else:
        original = type(optimizer).scale_loss.__get__(optimizer)
        counted = replaced_methods(optimizer, {"scale_loss": lambda loss: original(loss) * share})
    with counted, replica_batch_share(share):
        yield


def custom_logs_averaged(model, kind, logs):
    """A custom ``{kind}_step``'s logs, averaged over the replicas in a compiled step.

    Keras's own steps read their logs from the aggregated metrics: the same on
    every replica. A custom step may return its replica's own values (the
    ``stateless_result`` of its metric values, as Keras's JAX guide writes it);
    Keras's TensorFlow backend takes their mean over the replicas, and so does
    this. Float leaves only: anything else is the first replica's.
    """
    replica_context = _context.current_frame().replica_context
    if (
        not overrides_step(model, kind)
        or replica_context is None
        or replica_context.eager_index is not None
        or replica_context.num_replicas_in_sync == 1
    ):
        return logs
    leaves, treedef = jax.tree_util.tree_flatten(logs)
    floating = [i for i, x in enumerate(leaves) if _is_float_array(x)]
    if floating:
        means = replica_context.all_reduce("MEAN", [leaves[i] for i in floating])
        for i, mean in zip(floating, means):
            leaves[i] = mean
    return jax.tree_util.tree_unflatten(treedef, leaves)


def _is_float_array(x) -> bool:
    return isinstance(x, jax.Array) and jax.numpy.issubdtype(x.dtype, jax.numpy.floating)
