"""Turns TensorFlow device strings and JAX devices into ``jax.Device`` objects."""

import re
from collections.abc import Sequence

import jax

# "/gpu:0", "GPU:1", "/device:CPU:0", "/job:localhost/replica:0/task:0/device:CPU:0"
_DEVICE_RE = re.compile(r"(?:^|/)(?:device:)?(?P<kind>[A-Za-z]+):(?P<index>\d+)$")
_KIND_TO_PLATFORM = {"cpu": "cpu", "gpu": "gpu", "tpu": "tpu"}


def resolve_device(device: "str | jax.Device") -> jax.Device:
    """Returns the local ``jax.Device`` a TF-style device string names.

    >>> resolve_device("/cpu:0") == jax.devices("cpu")[0]
    True
    """
    if isinstance(device, jax.Device):
        return device
    if not isinstance(device, str):
        raise TypeError(
            "A device must be a string such as '/gpu:0' or a jax.Device. "
            f"Received: device={device!r}"
        )
    match = _DEVICE_RE.search(device.strip())
    platform = match and _KIND_TO_PLATFORM.get(match["kind"].lower())
    if not platform:
        raise ValueError(
            "Could not parse the device string. Expected a form such as '/gpu:0', "
            f"'GPU:1' or '/job:localhost/replica:0/task:0/device:CPU:0'. Received: "
            f"device={device!r}"
        )
    index = int(match["index"])
    try:
        candidates = jax.local_devices(backend=platform)
    except RuntimeError:
        candidates = []
    if index >= len(candidates):
        available = [device_name(d) for d in jax.local_devices()]
        raise ValueError(
            f"Device {device!r} does not exist on this host. Available devices: "
            f"{available}. Received: device={device!r}"
        )
    return candidates[index]


def resolve_devices(devices: "Sequence[str | jax.Device] | None") -> tuple:
    """Resolves a list of devices; ``None`` means every local device."""
    if devices is None:
        return tuple(jax.local_devices())
    if isinstance(devices, (str, jax.Device)):
        devices = [devices]
    resolved = tuple(resolve_device(d) for d in devices)
    if not resolved:
        raise ValueError(f"At least one device is needed. Received: devices={devices!r}")
    if len(set(resolved)) != len(resolved):
        raise ValueError(f"Devices must not repeat. Received: devices={devices!r}")
    return resolved


def device_name(device: jax.Device) -> str:
    """The TF-style full name of a local device, e.g. '/job:localhost/.../device:CPU:0'."""
    kind = device.platform.upper()
    index = jax.local_devices(backend=device.platform).index(device)
    task = jax.process_index()
    return f"/job:localhost/replica:0/task:{task}/device:{kind}:{index}"
