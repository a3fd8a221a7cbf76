"""``kd.coordinator``: scheduling functions onto a parameter-server cluster's workers.

The counterpart of ``tf.distribute.coordinator`` (also ``kd.experimental.coordinator``).

>>> import keras_dist as kd
>>> kd.coordinator.PerWorkerValues((1, 2)).values
(1, 2)
"""

from keras_dist.parameter_server.scheduling._cluster_coordinator import (
    ClusterCoordinator as ClusterCoordinator,
)
from keras_dist.parameter_server.scheduling._cluster_coordinator import (
    experimental_get_current_worker_index as experimental_get_current_worker_index,
)
from keras_dist.parameter_server.scheduling._per_worker import PerWorkerValues as PerWorkerValues
from keras_dist.parameter_server.scheduling._remote_value import RemoteValue as RemoteValue
from keras_dist.parameter_server.scheduling._worker_thread import (
    ClosureInputError as ClosureInputError,
)

PerWorkerValue = PerWorkerValues

__all__ = [
    "ClosureInputError",
    "ClusterCoordinator",
    "PerWorkerValue",
    "PerWorkerValues",
    "RemoteValue",
    "experimental_get_current_worker_index",
]
