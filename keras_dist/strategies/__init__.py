"""The strategies, one file each, and the contract they fulfil (``StrategyExtended``).

* ``_strategy``: ``Strategy``, the public face every strategy shares.
* ``_extended``: ``StrategyExtended``, the core contract between a strategy and
  the engines, inputs, Keras integration and callbacks (abilities only some
  strategies have are interfaces in ``keras_dist/_capabilities.py``).
* ``_default``, ``_one_device``, ``_mirrored``, ``_central_storage``,
  ``_multi_worker_mirrored``, ``_tpu``, ``_parameter_server``: the strategies
  (``_logical_devices``: TPU logical devices, a replica spanning several devices).
* ``_mesh_extended`` (with ``_placement``, ``_variable_registry`` and
  ``_mesh_reductions``): ``MeshRuntime``, the implementation for strategies whose
  replicas are the devices of one mesh. The parameter-server strategy runs on
  ``keras_dist/parameter_server/``.

>>> import keras_dist as kd
>>> from keras_dist import strategies
>>> strategies.MirroredStrategy is kd.MirroredStrategy
True
"""

from keras_dist.strategies._central_storage import CentralStorageStrategy as CentralStorageStrategy
from keras_dist.strategies._default import default_strategy as default_strategy
from keras_dist.strategies._extended import StrategyExtended as StrategyExtended
from keras_dist.strategies._mirrored import MirroredStrategy as MirroredStrategy
from keras_dist.strategies._multi_worker_mirrored import (
    CollectiveCommunication as CollectiveCommunication,
)
from keras_dist.strategies._multi_worker_mirrored import CollectiveHints as CollectiveHints
from keras_dist.strategies._multi_worker_mirrored import (
    CommunicationImplementation as CommunicationImplementation,
)
from keras_dist.strategies._multi_worker_mirrored import (
    CommunicationOptions as CommunicationOptions,
)
from keras_dist.strategies._multi_worker_mirrored import (
    ExperimentalMultiWorkerMirroredStrategy as ExperimentalMultiWorkerMirroredStrategy,
)
from keras_dist.strategies._multi_worker_mirrored import (
    MultiWorkerMirroredStrategy as MultiWorkerMirroredStrategy,
)
from keras_dist.strategies._one_device import OneDeviceStrategy as OneDeviceStrategy
from keras_dist.strategies._parameter_server import (
    ParameterServerStrategy as ParameterServerStrategy,
)
from keras_dist.strategies._strategy import Strategy as Strategy
from keras_dist.strategies._tpu import TPUStrategy as TPUStrategy

__all__ = [
    "CentralStorageStrategy",
    "CollectiveCommunication",
    "CollectiveHints",
    "CommunicationImplementation",
    "CommunicationOptions",
    "ExperimentalMultiWorkerMirroredStrategy",
    "MirroredStrategy",
    "MultiWorkerMirroredStrategy",
    "OneDeviceStrategy",
    "ParameterServerStrategy",
    "Strategy",
    "StrategyExtended",
    "TPUStrategy",
]
