"""The environment of a task's process: where it is in the cluster, and how many devices it sees.

A child reads its environment when the interpreter starts, before anything imports JAX, so
``XLA_FLAGS`` and ``JAX_PLATFORMS`` set here take effect.
"""

import os
import re

_DEVICE_COUNT_FLAG = "--xla_force_host_platform_device_count"
_DEVICE_COUNT = re.compile(re.escape(_DEVICE_COUNT_FLAG) + r"(=\S*)?")


def child_environment(
    tf_config: str,
    *,
    devices_per_worker: int | None = None,
    env: dict[str, str] | None = None,
    base: dict[str, str] | None = None,
) -> dict[str, str]:
    """The environment of one task: ``base`` (default ``os.environ``) with the task's settings.

    Args:
        tf_config: The task's ``TF_CONFIG`` (JSON).
        devices_per_worker: Simulated CPU devices for the task; ``None`` gives one CPU device
            (or the task's accelerators).
        env: Variables set for every task, over the inherited ones.
        base: The inherited environment.

    >>> parent = {"XLA_FLAGS": "--xla_force_host_platform_device_count=8 --xla_dump_to=/tmp"}
    >>> child_environment("{}", base=parent)["XLA_FLAGS"]
    '--xla_dump_to=/tmp'
    >>> env = child_environment("{}", devices_per_worker=2, base=parent)
    >>> env["XLA_FLAGS"], env["JAX_PLATFORMS"]
    ('--xla_dump_to=/tmp --xla_force_host_platform_device_count=2', 'cpu')
    """
    result = dict(os.environ if base is None else base)
    # The launching process may simulate several CPU devices (the test suite does); a task
    # gets one device unless it asks, so that N tasks are N devices, as on N machines.
    _set_flags(result, _without_device_count(result.get("XLA_FLAGS", "")))
    result["PYTHONUNBUFFERED"] = "1"
    result["KERAS_BACKEND"] = "jax"
    for key, value in (env or {}).items():
        if not isinstance(key, str) or not isinstance(value, str):
            raise TypeError(
                f"Environment variables must be strings. Received: env[{key!r}]={value!r}"
            )
        result[key] = value
    if devices_per_worker is not None:
        if not isinstance(devices_per_worker, int) or devices_per_worker < 1:
            raise ValueError(
                "`devices_per_worker` must be a positive integer. "
                f"Received: devices_per_worker={devices_per_worker!r}"
            )
        flags = _without_device_count(result.get("XLA_FLAGS", ""))
        _set_flags(result, f"{flags} {_DEVICE_COUNT_FLAG}={devices_per_worker}")
        result["JAX_PLATFORMS"] = "cpu"
    result["TF_CONFIG"] = tf_config
    return result


def devices_by_task(devices_per_worker, keys) -> dict:
    """Each task's simulated device count: one count for all, or one per task of ``keys``.

    Tasks may differ (worker 0 with 2 devices, worker 1 with 4), as machines do.

    >>> keys = [("worker", 0), ("worker", 1)]
    >>> devices_by_task([2, 4], keys)
    {('worker', 0): 2, ('worker', 1): 4}
    >>> devices_by_task(3, keys)
    {('worker', 0): 3, ('worker', 1): 3}
    """
    if isinstance(devices_per_worker, (list, tuple)):
        if len(devices_per_worker) != len(keys):
            raise ValueError(
                "`devices_per_worker` as a list needs one count per task "
                f"({len(keys)}: {', '.join(f'{t} {i}' for t, i in keys)}). "
                f"Received: devices_per_worker={list(devices_per_worker)!r}"
            )
        return dict(zip(keys, devices_per_worker))
    return dict.fromkeys(keys, devices_per_worker)


def _without_device_count(flags: str) -> str:
    return " ".join(_DEVICE_COUNT.sub("", flags).split())


def _set_flags(environment: dict[str, str], flags: str) -> None:
    flags = flags.strip()
    if flags:
        environment["XLA_FLAGS"] = flags
    else:
        environment.pop("XLA_FLAGS", None)
