"""`MirroredStrategy`: synchronous replicas on the devices of one machine."""

from keras_dist._devices import resolve_devices
from keras_dist.strategies._mesh_extended import MeshExtended
from keras_dist.strategies._strategy import Strategy


class MirroredStrategy(Strategy):
    """Synchronous training on several devices of one machine.

    Each variable is mirrored on every device; each replica processes its share
    of the global batch, and gradients are summed across replicas with one
    fused all-reduce before every replica applies the same update.

    Args:
        devices: TF device strings ("/gpu:0", "GPU:1", "/cpu:0") or
            ``jax.Device`` objects. Defaults to every local device of JAX's
            default backend.
        cross_device_ops: a ``CrossDeviceOps`` choosing the reduction path.
            Defaults to ``NcclAllReduce`` (one fused all-reduce).

    >>> import keras, keras_dist as kd
    >>> strategy = kd.MirroredStrategy(["/cpu:0", "/cpu:1"])
    >>> strategy.num_replicas_in_sync
    2
    >>> with strategy.scope():
    ...     model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
    """

    def __init__(self, devices=None, cross_device_ops=None):
        super().__init__(MeshExtended(self, resolve_devices(devices), cross_device_ops))
