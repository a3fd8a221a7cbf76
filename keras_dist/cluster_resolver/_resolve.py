"""``resolve_cluster``: detects which resolver fits the environment this process runs in."""

import os

from keras_dist.cluster_resolver._coordinator import KERAS_VARS
from keras_dist.cluster_resolver._coordinator import KerasDistributionClusterResolver
from keras_dist.cluster_resolver._coordinator import KubeflowClusterResolver
from keras_dist.cluster_resolver._openmpi import OpenMPIClusterResolver
from keras_dist.cluster_resolver._slurm import SlurmClusterResolver
from keras_dist.cluster_resolver._tf_config import TFConfigClusterResolver


def resolve_cluster(environ=None):
    """The resolver for the environment this process runs in, or ``None`` for one process.

    First match wins:

    1. ``TF_CONFIG`` with a cluster;
    2. ``KERAS_DISTRIBUTION_*``;
    3. Kubeflow's JAX variables;
    4. an OpenMPI ``mpirun`` job of more than one rank (``OMPI_COMM_WORLD_SIZE``);
    5. a Slurm step (``srun``) with more than one task.

    OpenMPI comes before Slurm: ranks that ``mpirun`` starts inside a Slurm
    allocation also see the allocation's ``SLURM_*`` variables, which describe
    the allocation (or mpirun's daemons), not the ranks. The explicit settings
    (1-3) come before both, so they override what a scheduler sets.
    ``environ`` defaults to ``os.environ``.

    >>> resolve_cluster({}) is None
    True
    >>> resolve_cluster({"JAX_COORDINATOR_ADDRESS": "h:1", "JAX_NUM_PROCESSES": "2",
    ...                  "JAX_PROCESS_ID": "0"}).coordinator_address
    'h:1'
    >>> resolve_cluster({"OMPI_COMM_WORLD_SIZE": "2", "OMPI_COMM_WORLD_RANK": "0",
    ...                  "OMPI_MCA_orte_hnp_uri": "65536.0;tcp://10.0.0.1:5000"}).master()
    '10.0.0.1:61441'
    """
    env = os.environ if environ is None else environ
    tf_config = TFConfigClusterResolver(environ=env)
    if tf_config.cluster_spec():
        return tf_config
    if all(env.get(name) for name in KERAS_VARS):
        return KerasDistributionClusterResolver(environ=env)
    if KubeflowClusterResolver.detect(env):
        return KubeflowClusterResolver(environ=env)
    if OpenMPIClusterResolver.detect(env):
        return OpenMPIClusterResolver(environ=env)
    # srun sets SLURM_STEP_* for each task of a step. A batch script's own commands see
    # only the allocation's SLURM_NTASKS: one process, not a task of a cluster.
    num_tasks = env.get("SLURM_STEP_NUM_TASKS")
    if env.get("SLURM_PROCID") and num_tasks and int(num_tasks) > 1:
        if env.get("SLURM_STEP_NODELIST"):
            return SlurmClusterResolver(environ=env)
    return None
