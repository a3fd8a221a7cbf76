"""Partitioners: how many shards a variable is split into (TF's ``partitioners``).

A partitioner is called with ``(shape, dtype)`` and returns the number of
partitions along each axis; only the first axis may be split. The numbers
are TF's (``partitioned_variables.min_max_variable_partitioner`` and
``variable_axis_size_partitioner``).

>>> FixedShardsPartitioner(2)((10, 3), "float32")
[2, 1]
>>> MinSizePartitioner(min_shard_bytes=4, max_shards=2)((6, 1), "float32")
[2, 1]
>>> MaxSizePartitioner(max_shard_bytes=4)((6, 1), "float32")
[6, 1]
"""

import math

from keras_dist.parameter_server.rpc._wire import dtype_from_name


def _element_bytes(dtype, bytes_per_string: int) -> int:
    name = getattr(dtype, "name", dtype)
    if name in ("string", "str", "object"):
        return bytes_per_string
    return dtype_from_name(str(name)).itemsize


def _positive(name, value):
    if value < 1:
        raise ValueError(f"Argument `{name}` must be positive. Received: {value}")


class Partitioner:
    """Base class: ``__call__(shape, dtype, axis=0)`` returns partitions per axis."""

    def __call__(self, shape, dtype, axis=0):
        raise NotImplementedError(
            f"{type(self).__name__} is a Partitioner without `__call__(shape, dtype, axis=0)`: "
            "subclass Partitioner and return the number of partitions per axis, or use "
            "FixedShardsPartitioner, MinSizePartitioner or MaxSizePartitioner. "
            f"Received: shape={shape}, dtype={dtype}"
        )


class FixedShardsPartitioner(Partitioner):
    """Splits the first axis into ``num_shards`` (fewer when it has fewer rows)."""

    def __init__(self, num_shards: int):
        _positive("num_shards", num_shards)
        self._num_shards = num_shards

    def __call__(self, shape, dtype, axis=0):
        result = [1] * len(shape)
        result[axis] = min(self._num_shards, int(shape[axis]))
        return result


class MinSizePartitioner(Partitioner):
    """As many shards as keep each at least ``min_shard_bytes``, at most ``max_shards``."""

    def __init__(self, min_shard_bytes=256 << 10, max_shards=1, bytes_per_string=16):
        _positive("min_shard_bytes", min_shard_bytes)
        _positive("max_shards", max_shards)
        _positive("bytes_per_string", bytes_per_string)
        self._min_shard_bytes = min_shard_bytes
        self._max_shards = max_shards
        self._bytes_per_string = bytes_per_string

    def __call__(self, shape, dtype, axis=0):
        total = math.prod(int(d) for d in shape) * _element_bytes(dtype, self._bytes_per_string)
        partitions = total / self._min_shard_bytes
        result = [1] * len(shape)
        result[axis] = max(1, min(int(shape[axis]), self._max_shards, math.ceil(partitions)))
        return result


class MaxSizePartitioner(Partitioner):
    """As few shards as keep each at most ``max_shard_bytes`` (capped by ``max_shards``)."""

    def __init__(self, max_shard_bytes, max_shards=None, bytes_per_string=16):
        _positive("max_shard_bytes", max_shard_bytes)
        if max_shards is not None:
            _positive("max_shards", max_shards)
        _positive("bytes_per_string", bytes_per_string)
        self._max_shard_bytes = max_shard_bytes
        self._max_shards = max_shards
        self._bytes_per_string = bytes_per_string

    def __call__(self, shape, dtype, axis=0):
        rows = int(shape[axis])
        element = _element_bytes(dtype, self._bytes_per_string)
        bytes_per_slice = math.prod(int(d) for d in shape) / rows * element
        slices_per_shard = max(1, math.floor(self._max_shard_bytes / bytes_per_slice))
        shards = math.ceil(rows / slices_per_shard)
        if self._max_shards:
            shards = min(self._max_shards, shards)
        result = [1] * len(shape)
        result[axis] = shards
        return result


def shard_rows(shape, dtype, partitioner) -> list:
    """Rows per shard for a variable of ``shape`` (``[rows]`` when not partitioned).

    The first ``rows % n`` shards get one row more, as TF splits them.
    """
    if partitioner is None or not shape:
        return [shape[0]] if shape else [None]
    partitions = partitioner(tuple(shape), dtype)
    _check_partitions(partitions, shape)
    n = min(partitions[0], shape[0])
    base, extra = divmod(shape[0], n)
    return [base + (1 if i < extra else 0) for i in range(n)]


def _check_partitions(partitions, shape):
    if (
        not partitions
        or len(partitions) != len(shape)
        or partitions[0] != sum(partitions) - (len(partitions) - 1)
        or partitions[0] < 1
    ):
        raise ValueError(
            "variable_partitioner must return a list/tuple whose elements are 1 besides "
            "the first element (non-zero), and as many as the variable has axes. "
            f"Received: {partitions!r} for shape {tuple(shape)}"
        )
