"""Distributed values (``PerReplica``, ``Mirrored``) and distributed variables."""

from keras_dist._values._distributed_values import DistributedDelegate as DistributedDelegate
from keras_dist._values._distributed_values import DistributedValues as DistributedValues
from keras_dist._values._distributed_values import Mirrored as Mirrored
from keras_dist._values._distributed_values import PerReplica as PerReplica
from keras_dist._values._distributed_values import regroup as regroup
from keras_dist._values._distributed_values import replicated_components as replicated_components
from keras_dist._values._distributed_values import select_replica as select_replica
from keras_dist._values._distributed_values import unstack as unstack
