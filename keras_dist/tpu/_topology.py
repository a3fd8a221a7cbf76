"""``Topology``: where the TPU cores are (``tf.tpu.experimental.Topology``).

A topology is a mesh of cores with coordinates ``(x, y, z, core)``.
``device_coordinates[task, i]`` are the coordinates of TPU device ``i`` of
task (process) ``task``. On TPUs they come from JAX's ``device.coords`` and
``device.core_on_chip``; on simulated or non-TPU devices the topology is a line
of devices: device ``i`` is at ``(i, 0, 0, 0)``.
"""

import jax
import numpy as np

_RANK = 4  # x, y, z and the core on the chip, as in TF


def _coordinates(device, index) -> tuple:
    if device.platform == "tpu" and hasattr(device, "coords"):
        return (*device.coords, getattr(device, "core_on_chip", 0))
    return (index, 0, 0, 0)


class Topology:
    """The cores of a TPU system and their coordinates in its mesh.

    Use ``initialize_tpu_system(resolver)`` (or, a keras_dist addition,
    ``Topology.from_devices(devices)`` for GPUs and CPUs), rather than the
    constructor, which takes TF's arrays and then knows no ``jax.Device``
    (unless given ``devices``, a keras_dist addition: ``devices[task][i]`` is
    the device at ``device_coordinates[task, i]``).

    >>> import jax
    >>> topology = Topology.from_devices(jax.devices("cpu")[:4])
    >>> topology.mesh_shape.tolist(), topology.num_tasks, topology.num_tpus_per_task
    ([4, 1, 1, 1], 1, 4)
    >>> topology.device_coordinates[0, 2].tolist()
    [2, 0, 0, 0]
    """

    def __init__(self, serialized=None, mesh_shape=None, device_coordinates=None, *, devices=None):
        if serialized is not None:
            raise ValueError(
                "A serialized TopologyProto is TensorFlow's TPU runtime format, which "
                "JAX does not use. Build the topology with "
                "`kd.tpu.experimental.initialize_tpu_system(resolver)` or "
                "`Topology.from_devices(devices)`. Received: serialized="
                f"{serialized[:32]!r}"
            )
        if mesh_shape is None or device_coordinates is None:
            raise ValueError(
                "A Topology needs `mesh_shape` and `device_coordinates` (or use "
                "`Topology.from_devices(devices)`). Received: "
                f"mesh_shape={mesh_shape!r}, device_coordinates={device_coordinates!r}"
            )
        self._mesh_shape = np.asarray(mesh_shape, dtype=np.int32)
        coordinates = np.asarray(device_coordinates, dtype=np.int32)
        if coordinates.ndim != 3 or coordinates.shape[2] != len(self._mesh_shape):
            raise ValueError(
                "`device_coordinates` must have shape [num_tasks, num_tpus_per_task, "
                f"{len(self._mesh_shape)}] (one coordinate per mesh dimension). "
                f"Received: device_coordinates of shape {coordinates.shape}"
            )
        per_task = [len(task_devices) for task_devices in devices or ()]
        if devices is not None and per_task != [coordinates.shape[1]] * coordinates.shape[0]:
            raise ValueError(
                "`devices` must hold one device per coordinate, "
                f"[num_tasks][num_tpus_per_task] = {list(coordinates.shape[:2])}. "
                f"Received: devices per task={per_task}"
            )
        self._device_coordinates = coordinates
        self._devices = devices  # task -> its devices, when built from devices
        self._at = {
            tuple(int(c) for c in coordinates[task, i]): (task, i)
            for task in range(coordinates.shape[0])
            for i in range(coordinates.shape[1])
        }

    @classmethod
    def from_devices(cls, devices) -> "Topology":
        """The topology of ``devices`` (a keras_dist addition; any platform).

        TPU devices keep their physical coordinates; other devices form a line
        in the order given. Every process must hold as many of them.
        """
        devices = tuple(devices)
        if not devices:
            raise ValueError("A topology needs at least one device. Received: devices=()")
        by_task: dict = {}
        for index, device in enumerate(devices):
            by_task.setdefault(device.process_index, []).append((device, index))
        counts = {task: len(members) for task, members in by_task.items()}
        if len(set(counts.values())) != 1:
            raise ValueError(
                "Every process must hold the same number of the topology's devices. "
                f"Received: devices per process={counts}"
            )
        tasks = sorted(by_task)
        coordinates = [[_coordinates(d, i) for d, i in by_task[t]] for t in tasks]
        mesh_shape = np.max(np.asarray(coordinates).reshape(-1, _RANK), axis=0) + 1
        devices_by_task = [tuple(d for d, _ in by_task[t]) for t in tasks]
        return cls(mesh_shape=mesh_shape, device_coordinates=coordinates, devices=devices_by_task)

    @property
    def mesh_shape(self) -> np.ndarray:
        """The shape of the mesh of cores: ``[x, y, z, cores_per_chip]``."""
        return self._mesh_shape

    @property
    def mesh_rank(self) -> int:
        """How many dimensions the mesh has (4)."""
        return len(self._mesh_shape)

    @property
    def device_coordinates(self) -> np.ndarray:
        """``[num_tasks, num_tpus_per_task, mesh_rank]``: each TPU device's coordinates."""
        return self._device_coordinates

    @property
    def num_tasks(self) -> int:
        """How many tasks (hosts, processes) the TPU system has."""
        return self._device_coordinates.shape[0]

    @property
    def num_tpus_per_task(self) -> int:
        """How many TPU devices each task has."""
        return self._device_coordinates.shape[1]

    @property
    def missing_devices(self) -> np.ndarray:
        """The coordinates of the mesh with no device (a partial mesh), one per row."""
        everything = np.indices(self._mesh_shape).reshape(self.mesh_rank, -1).T
        missing = [c for c in everything if tuple(int(x) for x in c) not in self._at]
        return np.asarray(missing, dtype=np.int32).reshape(-1, self.mesh_rank)

    def _lookup(self, device_coordinates) -> tuple:
        key = tuple(int(c) for c in device_coordinates)
        if key not in self._at:
            raise ValueError(
                f"No device at coordinates {list(key)} in a topology of mesh shape "
                f"{self._mesh_shape.tolist()}. Received: device_coordinates={list(key)}"
            )
        return self._at[key]

    def task_ordinal_at_coordinates(self, device_coordinates) -> int:
        """The task that holds the device at ``device_coordinates``."""
        return self._lookup(device_coordinates)[0]

    def tpu_device_ordinal_at_coordinates(self, device_coordinates) -> int:
        """The index, within its task, of the device at ``device_coordinates``."""
        return self._lookup(device_coordinates)[1]

    def tpu_device_name_at_coordinates(self, device_coordinates, job=None) -> str:
        """The TF name of the device at ``device_coordinates``."""
        task, ordinal = self._lookup(device_coordinates)
        return f"/job:{job or 'worker'}/replica:0/task:{task}/device:TPU:{ordinal}"

    def cpu_device_name_at_coordinates(self, device_coordinates, job=None) -> str:
        """The TF name of the host CPU of the device at ``device_coordinates``."""
        task, _ = self._lookup(device_coordinates)
        return f"/job:{job or 'worker'}/replica:0/task:{task}/device:CPU:0"

    def device_at_coordinates(self, device_coordinates) -> jax.Device:
        """The ``jax.Device`` at ``device_coordinates`` (a keras_dist addition)."""
        task, ordinal = self._lookup(device_coordinates)
        if self._devices is None:
            raise ValueError(
                "This Topology was built from coordinates alone and knows no devices. "
                "Use `kd.tpu.experimental.initialize_tpu_system(resolver)` or "
                "`Topology.from_devices(devices)`. Received: device_coordinates="
                f"{[int(c) for c in device_coordinates]}"
            )
        return self._devices[task][ordinal]

    def __repr__(self):
        return (
            f"Topology(mesh_shape={self._mesh_shape.tolist()}, num_tasks={self.num_tasks}, "
            f"num_tpus_per_task={self.num_tpus_per_task})"
        )
