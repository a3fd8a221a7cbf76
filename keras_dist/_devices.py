"""Turns TensorFlow device strings and JAX devices into ``jax.Device`` objects."""

import re
import warnings
from collections.abc import Iterable
from collections.abc import Sequence

import jax

# "/gpu:0", "GPU:1", "/device:CPU:0", "/job:localhost/replica:0/task:0/device:CPU:0"
_DEVICE_RE = re.compile(r"(?:^|/)(?:device:)?(?P<kind>[A-Za-z]+):(?P<index>\d+)$")
_KIND_TO_PLATFORM = {"cpu": "cpu", "gpu": "gpu", "tpu": "tpu"}


def resolve_device(device: "str | jax.Device", name: str = "device") -> jax.Device:
    """Returns the local ``jax.Device`` a TF-style device string names.

    ``name`` is the argument's name in error messages.

    >>> resolve_device("/cpu:0") == jax.devices("cpu")[0]
    True
    """
    if isinstance(device, jax.Device):
        return device
    platform, index = _parsed(device, name)
    try:
        candidates = jax.local_devices(backend=platform)
    except RuntimeError:
        candidates = []
    if not candidates and platform != "cpu":
        return _on_the_cpu(device, platform.upper(), index, name)
    if index >= len(candidates):
        available = [device_name(d) for d in jax.local_devices()]
        raise ValueError(
            f"Device {device!r} does not exist on this host. Available devices: "
            f"{available}. Received: {name}={device!r}"
        )
    return candidates[index]


def check_device_name(device: "str | jax.Device", name: str = "device") -> None:
    """Raises where ``device`` is no device string or ``jax.Device``, without starting JAX.

    Whether the device exists is known once JAX's backends start (``resolve_device``);
    a multi-process job must start ``jax.distributed`` first.

    >>> check_device_name("/cpu:9")
    >>> check_device_name("cpu9", "reduce_to_device")
    Traceback (most recent call last):
    ...
    ValueError: Could not parse the device string. ... Received: reduce_to_device='cpu9'
    """
    if not isinstance(device, jax.Device):
        _parsed(device, name)


def _parsed(device, name) -> tuple:
    """``(platform, index)`` of a device string; raises for anything else."""
    if not isinstance(device, str):
        hint = ""
        if isinstance(device, int) and not isinstance(device, bool):
            hint = (
                f" To name device {device} of the default backend, pass "
                f"'/{_default_kind()}:{device}' or jax.devices()[{device}]."
            )
        raise TypeError(
            f"`{name}` must be a device string such as '/gpu:0' or a jax.Device."
            f"{hint} Received: {name}={device!r}"
        )
    match = _DEVICE_RE.search(device.strip())
    platform = match and _KIND_TO_PLATFORM.get(match["kind"].lower())
    if not platform:
        raise ValueError(
            "Could not parse the device string. Expected a form such as '/gpu:0', "
            f"'GPU:1' or '/job:localhost/replica:0/task:0/device:CPU:0'. Received: "
            f"{name}={device!r}"
        )
    return platform, int(match["index"])


def _on_the_cpu(device: str, kind: str, index: int, name: str) -> jax.Device:
    """A GPU or TPU named on a host that has none: the CPU device of the same index.

    TF's soft device placement runs a program written for GPUs on the CPU (a
    script from a GPU machine, tried on a laptop or a CPU-only CI). A replica
    here needs a device of its own: ``/gpu:1`` needs a second CPU device.
    """
    cpus = jax.local_devices(backend="cpu")
    if index >= len(cpus):
        raise ValueError(
            f"Device {device!r} does not exist on this host, which has no {kind}. TF "
            "would run it on the CPU; keras_dist runs each replica on a device of its "
            f"own, and this host has {len(cpus)} CPU device(s). Name fewer devices, or "
            f"set XLA_FLAGS=--xla_force_host_platform_device_count={index + 1} before "
            f"JAX starts to simulate more CPU devices. Received: {name}={device!r}"
        )
    warnings.warn(
        f"keras_dist: {device!r} names a {kind}, and this host has none: it runs on "
        f"CPU device {index} instead, as TF's soft device placement would run it.",
        stacklevel=4,
    )
    return cpus[index]


def resolve_devices(devices: "Sequence[str | jax.Device] | None", name: str = "devices") -> tuple:
    """Resolves a list of devices; ``None`` means every local device.

    ``name`` is the argument's name in error messages.
    """
    if devices is None:
        return tuple(jax.local_devices())
    if isinstance(devices, (str, jax.Device)):
        devices = [devices]
    if not isinstance(devices, Iterable):
        hint = ""
        if isinstance(devices, int) and not isinstance(devices, bool) and devices > 0:
            kind = _default_kind()
            names = ", ".join(f"'/{kind}:{i}'" for i in range(min(devices, 2)))
            more = ", ..." if devices > 2 else ""
            hint = (
                f" It cannot be a number of devices: to use the first {devices}, pass "
                f"jax.devices()[:{devices}] or [{names}{more}]."
            )
        raise TypeError(
            f"`{name}` must be a list of device strings (such as '/gpu:0') or "
            f"jax.Device objects.{hint} Received: {name}={devices!r}"
        )
    devices = list(devices)
    resolved = tuple(resolve_device(d, f"{name}[{i}]") for i, d in enumerate(devices))
    if not resolved:
        raise ValueError(f"At least one device is needed. Received: {name}={devices!r}")
    if len(set(resolved)) != len(resolved):
        raise ValueError(f"Devices must not repeat. Received: {name}={devices!r}")
    return resolved


def _default_kind() -> str:
    """The TF device kind of JAX's default backend ('cpu', 'gpu' or 'tpu')."""
    platform = jax.default_backend()
    return platform if platform in _KIND_TO_PLATFORM else "gpu"


def device_name(device: jax.Device) -> str:
    """The TF-style full name of a local device, e.g. '/job:localhost/.../device:CPU:0'."""
    kind = device.platform.upper()
    index = jax.local_devices(backend=device.platform).index(device)
    task = jax.process_index()
    return f"/job:localhost/replica:0/task:{task}/device:{kind}:{index}"
