"""`OneDeviceStrategy`: everything on one device, with the API of the other strategies."""

from keras_dist._devices import resolve_device
from keras_dist.strategies._mesh_extended import MeshExtended
from keras_dist.strategies._strategy import Strategy


class OneDeviceStrategy(Strategy):
    """Runs everything on one device, with the same API as the other strategies.

    >>> import keras_dist as kd
    >>> strategy = kd.OneDeviceStrategy("/cpu:0")
    >>> strategy.experimental_local_results(strategy.run(lambda: 4.0))
    (Array(4., dtype=float32, weak_type=True),)
    """

    def __init__(self, device):
        super().__init__(_OneDeviceExtended(self, (resolve_device(device),)))

    def experimental_distribute_values_from_function(self, value_fn):
        """``value_fn(ValueContext)``'s value on the device, itself (as TF's OneDeviceStrategy
        gives it: no ``PerReplica`` around one value).

        >>> import keras_dist as kd
        >>> strategy = kd.OneDeviceStrategy("/cpu:0")
        >>> float(strategy.experimental_distribute_values_from_function(lambda ctx: 3.0) * 2)
        6.0
        """
        value = super().experimental_distribute_values_from_function(value_fn)
        return self.experimental_local_results(value)[0]


class _OneDeviceExtended(MeshExtended):
    # TF's OneDeviceStrategy keeps plain variables: one with aggregation "none" reads.
    reads_sync_on_read_as_plain = True
