"""Variable partitioners for ``ParameterServerStrategy`` (TF's ``experimental.partitioners``).

>>> import keras_dist as kd
>>> kd.experimental.partitioners.FixedShardsPartitioner(2)((10, 3), "float32")
[2, 1]
"""

from keras_dist.parameter_server.variables._partitioners import (
    FixedShardsPartitioner as FixedShardsPartitioner,
)
from keras_dist.parameter_server.variables._partitioners import (
    MaxSizePartitioner as MaxSizePartitioner,
)
from keras_dist.parameter_server.variables._partitioners import (
    MinSizePartitioner as MinSizePartitioner,
)
from keras_dist.parameter_server.variables._partitioners import Partitioner as Partitioner

__all__ = [
    "FixedShardsPartitioner",
    "MaxSizePartitioner",
    "MinSizePartitioner",
    "Partitioner",
]
