"""Cluster resolution (``tf.distribute.cluster_resolver``) and multi-worker helpers."""

from keras_dist.cluster_resolver._base import ClusterResolver as ClusterResolver
from keras_dist.cluster_resolver._cluster_spec import ClusterSpec as ClusterSpec
from keras_dist.cluster_resolver._coordinator import (
    KerasDistributionClusterResolver as KerasDistributionClusterResolver,
)
from keras_dist.cluster_resolver._coordinator import (
    KubeflowClusterResolver as KubeflowClusterResolver,
)
from keras_dist.cluster_resolver._gce import GCEClusterResolver as GCEClusterResolver
from keras_dist.cluster_resolver._kubernetes import (
    KubernetesClusterResolver as KubernetesClusterResolver,
)
from keras_dist.cluster_resolver._kubernetes import (
    KubernetesExecutableLocation as KubernetesExecutableLocation,
)
from keras_dist.cluster_resolver._multi_worker import collective_leader as collective_leader
from keras_dist.cluster_resolver._multi_worker import id_in_cluster as id_in_cluster
from keras_dist.cluster_resolver._multi_worker import is_chief as is_chief
from keras_dist.cluster_resolver._multi_worker import (
    remove_temp_dir_with_filepath as remove_temp_dir_with_filepath,
)
from keras_dist.cluster_resolver._multi_worker import remove_temp_dirpath as remove_temp_dirpath
from keras_dist.cluster_resolver._multi_worker import should_checkpoint as should_checkpoint
from keras_dist.cluster_resolver._multi_worker import should_init as should_init
from keras_dist.cluster_resolver._multi_worker import should_save_summary as should_save_summary
from keras_dist.cluster_resolver._multi_worker import worker_count as worker_count
from keras_dist.cluster_resolver._multi_worker import write_dirpath as write_dirpath
from keras_dist.cluster_resolver._multi_worker import write_filepath as write_filepath
from keras_dist.cluster_resolver._openmpi import OpenMPIClusterResolver as OpenMPIClusterResolver
from keras_dist.cluster_resolver._resolve import resolve_cluster as resolve_cluster
from keras_dist.cluster_resolver._simple import SimpleClusterResolver as SimpleClusterResolver
from keras_dist.cluster_resolver._slurm import SlurmClusterResolver as SlurmClusterResolver
from keras_dist.cluster_resolver._tf_config import (
    TFConfigClusterResolver as TFConfigClusterResolver,
)
from keras_dist.cluster_resolver._tpu_resolver import TPUClusterResolver as TPUClusterResolver
from keras_dist.cluster_resolver._union import UnionClusterResolver as UnionClusterResolver
from keras_dist.cluster_resolver._union import UnionResolver as UnionResolver

__all__ = [
    "ClusterResolver",
    "ClusterSpec",
    "GCEClusterResolver",
    "KerasDistributionClusterResolver",
    "KubeflowClusterResolver",
    "KubernetesClusterResolver",
    "KubernetesExecutableLocation",
    "OpenMPIClusterResolver",
    "SimpleClusterResolver",
    "SlurmClusterResolver",
    "TFConfigClusterResolver",
    "TPUClusterResolver",
    "UnionClusterResolver",
    "UnionResolver",
    "collective_leader",
    "id_in_cluster",
    "is_chief",
    "remove_temp_dir_with_filepath",
    "remove_temp_dirpath",
    "resolve_cluster",
    "should_checkpoint",
    "should_init",
    "should_save_summary",
    "worker_count",
    "write_dirpath",
    "write_filepath",
]
