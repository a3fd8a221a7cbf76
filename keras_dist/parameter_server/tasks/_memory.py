"""Memory settings for a process that is one parameter-server task.

Every step of parameter-server training allocates and frees a few buffers of
the model's size in the ps and worker processes: the request's bytes, the
reply, the updated values. glibc hands buffers that large back to the kernel
when they are freed, so each request page-faults its buffers in again (one
fault per 4 KiB page, zeroed by the kernel). Measured here on an MLP of
2.7 MB per step: ~900 faults a step on the ps, about a fifth of its CPU time.
``keep_freed_buffers`` keeps them in the heap for the next request instead.
"""

import ctypes
import os
import sys

from keras_dist.cluster_resolver import TFConfigClusterResolver

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3


def is_own_task(job_name: str, task_index: int) -> bool:
    """Whether ``TF_CONFIG`` says this process is that task (not an in-process cluster)."""
    resolver = TFConfigClusterResolver()
    try:
        return resolver.task_type == job_name and resolver.task_id == task_index
    except ValueError:  # TF_CONFIG that is not JSON: the server's own checks report it
        return False


def keep_freed_buffers() -> bool:
    """Keeps freed buffers up to 32 MiB (glibc's ceiling) in this process's heap.

    Applies to the whole process, so only a process that is a ps or worker
    task calls it. Does nothing off Linux's glibc, or where the user set
    glibc's own ``MALLOC_MMAP_THRESHOLD_``/``MALLOC_TRIM_THRESHOLD_``. Returns
    whether the settings were made.
    """
    if not sys.platform.startswith("linux"):
        return False
    if any(name in os.environ for name in ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_")):
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):  # not glibc (musl, say)
        return False
    # A freed buffer below 32 MiB stays in the heap; the heap is trimmed back
    # to the kernel only past 256 MiB of free space at its top.
    return bool(mallopt(_M_MMAP_THRESHOLD, 32 << 20)) and bool(
        mallopt(_M_TRIM_THRESHOLD, 256 << 20)
    )
