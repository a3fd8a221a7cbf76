"""Which devices the benchmarks run on: the accelerators when there are any, else simulated CPUs.

The device-count flag must be set before JAX starts, so the accelerators are
looked up by their device files, not through JAX. On a GPU or TPU machine no
CPU-only flag is set and ``jax.devices()`` are the accelerators.

>>> import os
>>> os.environ.get("JAX_PLATFORMS") == "cpu" or isinstance(has_accelerator(), bool)
True
"""

import glob
import os


def has_accelerator() -> bool:
    """Whether this machine has an NVIDIA/AMD GPU or a TPU that JAX is allowed to use."""
    if os.environ.get("JAX_PLATFORMS", "").strip() == "cpu":
        return False
    device_files = glob.glob("/dev/nvidia[0-9]*") + glob.glob("/dev/accel[0-9]*")
    return bool(device_files) or os.path.exists("/dev/kfd")


def simulate_cpu_devices(count: int) -> None:
    """Asks JAX for ``count`` CPU devices, unless accelerators exist or XLA_FLAGS is already set."""
    if not has_accelerator():
        os.environ.setdefault("XLA_FLAGS", f"--xla_force_host_platform_device_count={count}")
