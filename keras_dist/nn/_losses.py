"""Loss scaling for distributed training (``tf.nn.compute_average_loss`` and friends)."""

import jax.numpy as jnp

from keras_dist import _context


def _num_replicas(caller: str) -> int:
    """The replicas in sync where ``caller`` runs: refused in a strategy's cross-replica
    context, where no replica's batch is at hand (TF's error)."""
    frame = _context.current_frame()
    if frame.replica_context is not None:
        return frame.replica_context.num_replicas_in_sync
    if _context.has_strategy():
        raise RuntimeError(
            f"You are calling `{caller}` in cross replica context, while it was expected "
            "to be called in replica context: call it inside the function you pass to "
            f"`strategy.run`. Received: a call in {type(frame.strategy).__name__}'s scope, "
            "outside `strategy.run`"
        )
    return frame.strategy.num_replicas_in_sync


def compute_average_loss(per_example_loss, sample_weight=None, global_batch_size=None):
    """Sums ``per_example_loss`` and divides by the global batch size.

    In a replica, the global batch size defaults to this replica's batch size
    times ``num_replicas_in_sync``, so that summing the replicas' losses (and
    gradients) gives the mean over the global batch. An empty batch gives 0.
    Without ``global_batch_size``, a call in a strategy's scope but outside
    ``strategy.run`` raises ``RuntimeError``, as in TF.

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
        global_batch_size = per_example_loss.shape[0] * _num_replicas("compute_average_loss")
    if isinstance(global_batch_size, int) and global_batch_size == 0:
        return jnp.zeros((), per_example_loss.dtype)
    total = jnp.sum(per_example_loss)
    return total / jnp.asarray(global_batch_size, total.dtype)


def scale_regularization_loss(regularization_loss):
    """Sums the regularization losses and divides by ``num_replicas_in_sync``.

    Summing across replicas then counts the regularization once. A call in a
    strategy's scope but outside ``strategy.run`` raises ``RuntimeError``, as in TF.

    >>> float(scale_regularization_loss([1.0, 3.0]))
    4.0
    """
    if isinstance(regularization_loss, (list, tuple)):
        regularization_loss = sum(jnp.asarray(x) for x in regularization_loss)
    return jnp.asarray(regularization_loss) / _num_replicas("scale_regularization_loss")
