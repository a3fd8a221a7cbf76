"""Keras's loss reductions under a strategy: each replica's loss counts as one device's would.

Keras reduces a loss in ``losses.loss.reduce_values`` and leaves distribution to two
hooks, ``scale_loss_for_distribution`` and ``unscale_loss_for_distribution``, that
only its TensorFlow backend fills in (``1 / num_replicas`` for the mean-type
reductions in a replica, as ``tf.distribute`` does). keras_dist fills them in on JAX,
in two settings:

* In ``fit``/``evaluate``'s replica steps the replica's share of the global batch is
  known (``replica_batch_share``, its rows over the global batch's): the gradient
  counts the replica's loss by that share (``optimizer.scale_loss``), and Keras's
  loss tracker averages the replicas' losses weighted by their rows. A mean-type
  loss is therefore left as it is; a ``"sum"`` loss, a sum over the global batch,
  becomes the replica's sum divided by its share (the tracker's average and the
  gradient's sum then both give the global sum); ``"mean_with_sample_weight"``
  divides by the sample weights of the whole global batch (one all-reduce, or the
  sums a first pass over every replica's rows found: ``global_sample_weights``).
* In a custom loop's replica (``strategy.run``), a mean-type loss is divided by
  ``num_replicas_in_sync``, as Keras on TensorFlow divides it, so that the sum of the
  replicas' gradients is the global batch's mean gradient; a ``"sum"`` loss is left
  as it is (the replicas' sums add up to the global sum).

A replica without rows (a last batch smaller than the replica count) has a loss of
0, as in tf-keras, however the model makes its loss.
"""

import functools
import threading

import jax
from keras import ops

from keras_dist import _context
from keras_dist._keras._internals import Trainer
from keras_dist._keras._internals import loss_module
from keras_dist._thread_state import set_for_block

_MEAN_REDUCTIONS = ("sum_over_batch_size", "mean", "mean_with_sample_weight")


class _BatchShare(threading.local):
    def __init__(self):
        self.value = None  # this replica's rows over the global batch's, in fit's steps
        self.weights = None  # the global batch's weight sums to divide by, in call order
        self.recorded = None  # the list a first pass records the replica's weight sums in


_share = _BatchShare()


def replica_batch_share(share):
    """Within, Keras losses reduce as a part of a global batch of which this replica
    holds ``share`` (a float, or a traced scalar), as ``fit``'s replica steps run.

    >>> import numpy as np
    >>> from keras import losses
    >>> loss = losses.MeanSquaredError(reduction="sum")
    >>> with replica_batch_share(0.5):  # half of the global batch's rows
    ...     float(loss(np.ones((2, 1)), np.zeros((2, 1))))
    4.0
    """
    return set_for_block(_share, "value", share)


def recording_sample_weights(recorded: list):
    """Within, each ``mean_with_sample_weight`` loss reduced under ``replica_batch_share``
    appends its rows' sample-weight sum to ``recorded`` (a first pass over a replica's rows,
    for steps that cannot all-reduce: ``global_sample_weights``)."""
    return set_for_block(_share, "recorded", recorded)


def global_sample_weights(sums):
    """Within, the ``mean_with_sample_weight`` losses divide by ``sums``: the global batch's
    sample-weight sums, one a loss in the order they are reduced (no collective)."""
    return set_for_block(_share, "weights", None if sums is None else iter(sums))


def _custom_loop_replicas() -> int:
    """The replica count a custom loop's replica divides a mean loss by (1 elsewhere)."""
    if _share.value is not None:
        return 1
    replica_context = _context.running_replica_context()
    if replica_context is None:
        return 1
    return replica_context.num_replicas_in_sync


def _scale_loss_for_distribution(value):
    replicas = _custom_loop_replicas()
    if replicas == 1:
        return value
    return ops.multiply(value, ops.cast(1.0 / replicas, value.dtype))


def _unscale_loss_for_distribution(value):
    replicas = _custom_loop_replicas()
    if replicas == 1:
        return value
    return ops.multiply(value, ops.cast(replicas, value.dtype))


def _wrap_reduce_values(original):
    @functools.wraps(original)
    def reduce_values(values, sample_weight=None, reduction="sum_over_batch_size"):
        shape = tuple(getattr(values, "shape", ()))
        share = _share.value
        if reduction in (None, "none") or shape == ():
            return original(values, sample_weight, reduction)
        if share is not None and reduction == "mean_with_sample_weight":
            if sample_weight is not None:
                # (before the empty batch's 0: every replica joins the all-reduce)
                mean = _global_weighted_mean(values, sample_weight)
                return ops.divide_no_nan(mean, ops.cast(share, mean.dtype))
        if 0 in shape and _context.has_strategy():
            # tf-keras reduces an empty batch to 0 (``divide_no_nan``); Keras 3 returns the
            # empty array, which is no scalar to differentiate and turns the metric NaN.
            return ops.zeros((), dtype=values.dtype)
        loss = original(values, sample_weight, reduction)
        if share is not None and reduction == "sum":
            return ops.divide(loss, ops.cast(share, loss.dtype))
        return loss

    return reduce_values


def _global_weighted_mean(values, sample_weight):
    """The replica's weighted sum over the sample weights of every replica's rows."""
    replica_context = _context.running_replica_context()
    if replica_context is None and _share.recorded is None and _share.weights is None:
        raise RuntimeError(
            "A `mean_with_sample_weight` loss in a replica step needs the other replicas' "
            "sample weights, and this step runs outside any replica context."
        )
    total = ops.sum(values)
    weight = ops.cast(ops.sum(sample_weight), total.dtype)
    if _share.recorded is not None:
        _share.recorded.append(weight)
        return ops.divide_no_nan(total, weight)
    if _share.weights is not None:
        return ops.divide_no_nan(total, ops.cast(next(_share.weights), total.dtype))
    if replica_context.num_replicas_in_sync == 1:
        return ops.divide_no_nan(total, weight)
    try:
        weight = replica_context.all_reduce("SUM", weight)
    except RuntimeError as error:
        # A replica on a thread of its own cannot take part in a collective from inside
        # the gradient Keras's step takes of its loss (the engine refuses it).
        raise ValueError(
            'A loss with `reduction="mean_with_sample_weight"` divides by the sample '
            "weights of the whole global batch, which a model's own `train_step` cannot "
            "all-reduce inside its gradient on a batch whose rows do not split evenly "
            "between the replicas. Make every global "
            "batch (the last one included) a multiple of the replica count, e.g. with "
            '`drop_remainder=True`, or use `reduction="sum_over_batch_size"`. Received: '
            f"a replica of {replica_context.num_replicas_in_sync} with its own shapes "
            f"(rows={values.shape[0] if values.shape else 0})"
        ) from error
    return ops.divide_no_nan(total, weight)


def _wrap_compute_loss(original):
    """A replica without rows has a loss of 0 however the model makes its loss.

    ``reduce_values`` covers compiled losses; a layer's ``add_loss`` of a mean,
    or an overridden ``compute_loss``, is NaN on no rows. Its share of the
    gradient is 0 anyway, but Keras's loss tracker adds ``NaN * 0`` rows and
    the reported loss became NaN.
    """

    @functools.wraps(original)
    def _compute_loss(self, x=None, y=None, y_pred=None, sample_weight=None, training=True):
        loss = original(self, x, y, y_pred, sample_weight, training)
        if _context.has_strategy() and _has_no_rows(x):
            return ops.zeros_like(loss)
        return loss

    return _compute_loss


def _has_no_rows(x) -> bool:
    leaves = [leaf for leaf in jax.tree_util.tree_leaves(x) if hasattr(leaf, "shape")]
    return bool(leaves) and len(leaves[0].shape) > 0 and leaves[0].shape[0] == 0


def needs_every_replica(model) -> bool:
    """Whether ``model``'s compiled losses reduce over every replica's rows at once
    (``mean_with_sample_weight``: one all-reduce of the sample weights in the step)."""
    compiled = getattr(model, "loss", None)
    losses = compiled.values() if isinstance(compiled, dict) else compiled
    if not isinstance(losses, (list, tuple)):
        losses = [losses]
    return any(getattr(loss, "reduction", None) == "mean_with_sample_weight" for loss in losses)


def install_loss_hooks() -> None:
    """Keras's loss reductions and distribution hooks as described above (once)."""
    if getattr(loss_module.reduce_values, "_keras_dist_hook", False):
        return
    reduce_values = _wrap_reduce_values(loss_module.reduce_values)
    reduce_values._keras_dist_hook = True
    loss_module.reduce_values = reduce_values
    loss_module.scale_loss_for_distribution = _scale_loss_for_distribution
    loss_module.unscale_loss_for_distribution = _unscale_loss_for_distribution
    Trainer._compute_loss = _wrap_compute_loss(Trainer._compute_loss)
