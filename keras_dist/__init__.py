"""keras_dist: the tf.distribute API for Keras 3 on JAX.

Port a tf.distribute program by replacing ``tf.distribute`` with
``keras_dist``:

>>> import keras, keras_dist as kd
>>> strategy = kd.MirroredStrategy()
>>> with strategy.scope():
...     model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
"""

from keras_dist._backend import ensure_jax_backend

ensure_jax_backend()

from keras_dist import _keras  # noqa: E402
from keras_dist import _keras_steps  # noqa: E402
from keras_dist import callbacks as callbacks  # noqa: E402
from keras_dist import cluster_resolver as cluster_resolver  # noqa: E402
from keras_dist import config as config  # noqa: E402
from keras_dist import coordinator as coordinator  # noqa: E402
from keras_dist import data as data  # noqa: E402
from keras_dist import errors as errors  # noqa: E402
from keras_dist import experimental as experimental  # noqa: E402
from keras_dist import layers as layers  # noqa: E402
from keras_dist import nn as nn  # noqa: E402
from keras_dist import testing as testing  # noqa: E402
from keras_dist import tpu as tpu  # noqa: E402
from keras_dist import train as train  # noqa: E402
from keras_dist._context import experimental_set_strategy as experimental_set_strategy  # noqa: E402
from keras_dist._context import get_cross_replica_context as get_cross_replica_context  # noqa: E402
from keras_dist._context import get_replica_context as get_replica_context  # noqa: E402
from keras_dist._context import get_strategy as get_strategy  # noqa: E402
from keras_dist._context import has_strategy as has_strategy  # noqa: E402
from keras_dist._context import in_cross_replica_context as in_cross_replica_context  # noqa: E402
from keras_dist._cross_device_ops import CrossDeviceOps as CrossDeviceOps  # noqa: E402
from keras_dist._cross_device_ops import HierarchicalCopyAllReduce as HierarchicalCopyAllReduce  # noqa: E402
from keras_dist._cross_device_ops import NcclAllReduce as NcclAllReduce  # noqa: E402
from keras_dist._cross_device_ops import ReductionToOneDevice as ReductionToOneDevice  # noqa: E402
from keras_dist._engine import Function as Function  # noqa: E402
from keras_dist._engine import function as function  # noqa: E402
from keras_dist._input import DistributedDataset as DistributedDataset  # noqa: E402
from keras_dist._input import DistributedIterator as DistributedIterator  # noqa: E402
from keras_dist._input import InputContext as InputContext  # noqa: E402
from keras_dist._input import InputOptions as InputOptions  # noqa: E402
from keras_dist._input import InputReplicationMode as InputReplicationMode  # noqa: E402
from keras_dist._keras_steps import value_and_grad as value_and_grad  # noqa: E402
from keras_dist._launch import launch as launch  # noqa: E402
from keras_dist._reduce_op import ReduceOp as ReduceOp  # noqa: E402
from keras_dist._replica_context import ReplicaContext as ReplicaContext  # noqa: E402
from keras_dist._run_options import RunOptions as RunOptions  # noqa: E402
from keras_dist._values import DistributedValues as DistributedValues  # noqa: E402
from keras_dist._values import Mirrored as Mirrored  # noqa: E402
from keras_dist._values import PerReplica as PerReplica  # noqa: E402
from keras_dist._values._variables import MirroredVariable as MirroredVariable  # noqa: E402
from keras_dist._values._variables import SyncOnReadVariable as SyncOnReadVariable  # noqa: E402
from keras_dist.parameter_server.tasks._server import Server as Server  # noqa: E402
from keras_dist.strategies import MirroredStrategy as MirroredStrategy  # noqa: E402
from keras_dist.strategies import MultiWorkerMirroredStrategy as MultiWorkerMirroredStrategy  # noqa: E402
from keras_dist.strategies import OneDeviceStrategy as OneDeviceStrategy  # noqa: E402
from keras_dist.strategies import ParameterServerStrategy as ParameterServerStrategy  # noqa: E402
from keras_dist.strategies import Strategy as Strategy  # noqa: E402
from keras_dist.strategies import StrategyExtended as StrategyExtended  # noqa: E402
from keras_dist.strategies import TPUStrategy as TPUStrategy  # noqa: E402

_keras.install_hooks(
    _keras_steps.KERAS_INTEGRATION,
    _keras_steps.apply_in_replica_context,
    callbacks.ModelCheckpoint,
)

__version__ = "0.1.0"

__all__ = [
    "CrossDeviceOps",
    "DistributedDataset",
    "DistributedIterator",
    "DistributedValues",
    "Function",
    "HierarchicalCopyAllReduce",
    "InputContext",
    "InputOptions",
    "InputReplicationMode",
    "Mirrored",
    "MirroredStrategy",
    "MirroredVariable",
    "MultiWorkerMirroredStrategy",
    "NcclAllReduce",
    "OneDeviceStrategy",
    "ParameterServerStrategy",
    "PerReplica",
    "ReduceOp",
    "ReductionToOneDevice",
    "ReplicaContext",
    "RunOptions",
    "Server",
    "Strategy",
    "StrategyExtended",
    "SyncOnReadVariable",
    "TPUStrategy",
    "callbacks",
    "cluster_resolver",
    "config",
    "coordinator",
    "data",
    "errors",
    "experimental",
    "experimental_set_strategy",
    "function",
    "get_cross_replica_context",
    "get_replica_context",
    "get_strategy",
    "has_strategy",
    "in_cross_replica_context",
    "launch",
    "layers",
    "nn",
    "testing",
    "tpu",
    "train",
    "value_and_grad",
]
