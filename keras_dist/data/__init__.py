"""Input helpers: auto-sharding between workers (``tf.data`` distribute options)."""

from keras_dist.data._sharding import AutoShardPolicy as AutoShardPolicy
from keras_dist.data._sharding import FileDataset as FileDataset
from keras_dist.data._sharding import auto_shard as auto_shard
from keras_dist.data._sharding import with_auto_shard_policy as with_auto_shard_policy

__all__ = ["AutoShardPolicy", "FileDataset", "auto_shard", "with_auto_shard_policy"]
