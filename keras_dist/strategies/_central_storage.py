"""`CentralStorageStrategy`: variables on one device, computation on every replica."""

import jax

from keras_dist._devices import resolve_device
from keras_dist._devices import resolve_devices
from keras_dist.strategies._mesh_extended import MeshExtended
from keras_dist.strategies._strategy import Strategy


def _default_parameter_device(compute_devices):
    """The host CPU when the replicas are accelerators; else the first replica's device."""
    if compute_devices[0].platform != "cpu":
        try:
            return jax.local_devices(backend="cpu")[0]
        except RuntimeError:
            pass
    return compute_devices[0]


class CentralStorageStrategy(Strategy):
    """Synchronous training with variables kept on one device, as TF's.

    Each step copies the variables to every replica, runs the replicas, sums
    their gradients and writes the updated variables back to the parameter
    device. Results are the same as ``MirroredStrategy``'s.

    Unlike TF, gradient clipping (``clipnorm``, ``clipvalue``,
    ``global_clipnorm``) works: the optimizer runs once on the summed
    gradients. As with ``MirroredStrategy``, a variable with aggregation
    ``"none"`` may be written from a replica when every replica writes the same
    value (TF2's rule); TF's ``AggregatingVariable`` refused that.

    Args:
        compute_devices: the replicas' devices (TF strings or ``jax.Device``);
            every local device by default.
        parameter_device: where variables are stored; the host CPU when the
            replicas are accelerators, else the first replica's device.

    >>> import keras_dist as kd
    >>> strategy = kd.experimental.CentralStorageStrategy(["/cpu:0", "/cpu:1"])
    >>> strategy.extended.parameter_devices
    ('/job:localhost/replica:0/task:0/device:CPU:0',)
    """

    def __init__(self, compute_devices=None, parameter_device=None):
        devices = resolve_devices(compute_devices, "compute_devices")
        parameter = (
            resolve_device(parameter_device, "parameter_device")
            if parameter_device is not None
            else _default_parameter_device(devices)
        )
        super().__init__(MeshExtended(self, devices, parameter_device=parameter))
