"""Layers that need a strategy to do their work."""

from keras_dist.layers._sync_batch_normalization import (
    SyncBatchNormalization as SyncBatchNormalization,
)

__all__ = ["SyncBatchNormalization"]
