"""Loss scaling for distributed training (``tf.nn.compute_average_loss`` and friends)."""

import jax.numpy as jnp

from keras_dist import _context


def _num_replicas() -> int:
    frame = _context.current_frame()
    if frame.replica_context is not None:
        return frame.replica_context.num_replicas_in_sync
    return frame.strategy.num_replicas_in_sync


def compute_average_loss(per_example_loss, sample_weight=None, global_batch_size=None):
    """Sums ``per_example_loss`` and divides by the global batch size.

    In a replica, the global batch size defaults to this replica's batch size
    times ``num_replicas_in_sync``, so that summing the replicas' losses (and
    gradients) gives the mean over the global batch. An empty batch gives 0.

    >>> float(compute_average_loss([1.0, 2.0, 3.0, 4.0]))
    2.5
    """
    per_example_loss = jnp.asarray(per_example_loss)
    if per_example_loss.ndim == 0:
        raise ValueError(
            "Invalid value passed for `per_example_loss`. Expected a tensor with at "
            f"least rank 1. Received: per_example_loss={per_example_loss}"
        )
    if sample_weight is not None:
        per_example_loss = per_example_loss * jnp.asarray(sample_weight, per_example_loss.dtype)
    if global_batch_size is None:
        global_batch_size = per_example_loss.shape[0] * _num_replicas()
    if isinstance(global_batch_size, int) and global_batch_size == 0:
        return jnp.zeros((), per_example_loss.dtype)
    total = jnp.sum(per_example_loss)
    return total / jnp.asarray(global_batch_size, total.dtype)


def scale_regularization_loss(regularization_loss):
    """Sums the regularization losses and divides by ``num_replicas_in_sync``.

    Summing across replicas then counts the regularization once.

    >>> float(scale_regularization_loss([1.0, 3.0]))
    4.0
    """
    if isinstance(regularization_loss, (list, tuple)):
        regularization_loss = sum(jnp.asarray(x) for x in regularization_loss)
    return jnp.asarray(regularization_loss) / _num_replicas()
