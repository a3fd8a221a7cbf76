"""`SyncBatchNormalization`: batch statistics over the global batch, on every replica."""

import keras
from keras import ops

from keras_dist._context import running_replica_context


class SyncBatchNormalization(keras.layers.BatchNormalization):
    """Batch normalization whose training statistics cover all replicas' rows.

    Inside ``strategy.run`` (and so in ``fit`` under a strategy) the mean and
    variance are computed over the global batch with two all-reduces, so the
    layer gives what ``BatchNormalization`` gives on one device with the whole
    batch; its gradients flow through the all-reduces. Outside a replica, or on
    one replica, it is ``BatchNormalization``. This is what
    ``BatchNormalization(synchronized=True)`` does on TensorFlow (Keras refuses
    that argument on JAX).

    The global statistics need one compiled program over equal per-replica
    batches: a last partial batch that splits unevenly between replicas cannot
    be differentiated through them (make the dataset size a multiple of the
    global batch size).

    >>> import keras, keras_dist as kd
    >>> layer = kd.layers.SyncBatchNormalization(momentum=0.9)
    >>> layer.build((None, 3))
    >>> [v.name for v in layer.non_trainable_weights]
    ['moving_mean', 'moving_variance']
    """

    def _moments(self, inputs, mask):
        replica_context = running_replica_context()
        if replica_context is None or replica_context.num_replicas_in_sync == 1:
            return super()._moments(inputs, mask)
        axes = self._reduction_axes
        if mask is None:
            weights = ops.ones_like(inputs)
        else:
            weights = ops.broadcast_to(
                ops.cast(ops.expand_dims(mask, -1), inputs.dtype), ops.shape(inputs)
            )
        local_sum = ops.sum(inputs * weights, axes, keepdims=True)
        local_count = ops.sum(weights, axes, keepdims=True)
        total, count = replica_context.all_reduce("SUM", [local_sum, local_count])
        mean = total / ops.maximum(count, 1.0)
        squared = ops.sum(ops.square((inputs - mean) * weights), axes, keepdims=True)
        variance = replica_context.all_reduce("SUM", squared) / ops.maximum(count, 1.0)
        return ops.squeeze(mean), ops.squeeze(variance)
