"""Loss helpers for distributed training (``tf.nn`` counterparts)."""

from keras_dist.nn._losses import compute_average_loss as compute_average_loss
from keras_dist.nn._losses import scale_regularization_loss as scale_regularization_loss

__all__ = ["compute_average_loss", "scale_regularization_loss"]
