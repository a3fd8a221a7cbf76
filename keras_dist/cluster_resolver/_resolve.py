"""``resolve_cluster``: detects which resolver fits the environment this process runs in."""

import os

from keras_dist.cluster_resolver._coordinator import KERAS_VARS
from keras_dist.cluster_resolver._coordinator import KerasDistributionClusterResolver
from keras_dist.cluster_resolver._coordinator import KubeflowClusterResolver
from keras_dist.cluster_resolver._slurm import SlurmClusterResolver
from keras_dist.cluster_resolver._tf_config import TFConfigClusterResolver


def resolve_cluster(environ=None):
    """The resolver for the environment this process runs in, or ``None`` for one process.

    First match wins: ``TF_CONFIG`` with a cluster, ``KERAS_DISTRIBUTION_*``,
    Kubeflow's JAX variables, a Slurm step with more than one task.
    ``environ`` defaults to ``os.environ``.

    >>> resolve_cluster({}) is None
    True
    >>> resolve_cluster({"JAX_COORDINATOR_ADDRESS": "h:1", "JAX_NUM_PROCESSES": "2",
    ...                  "JAX_PROCESS_ID": "0"}).coordinator_address
    'h:1'
    """
    env = os.environ if environ is None else environ
    tf_config = TFConfigClusterResolver(environ=env)
    if tf_config.cluster_spec():
        return tf_config
    if all(env.get(name) for name in KERAS_VARS):
        return KerasDistributionClusterResolver(environ=env)
    if KubeflowClusterResolver.detect(env):
        return KubeflowClusterResolver(environ=env)
    # A Slurm allocation of one task is one process; srun sets SLURM_PROCID for each task.
    num_tasks = env.get("SLURM_STEP_NUM_TASKS") or env.get("SLURM_NTASKS")
    has_nodes = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST")
    if env.get("SLURM_PROCID") and num_tasks and int(num_tasks) > 1 and has_nodes:
        return SlurmClusterResolver(environ=env)
    return None
