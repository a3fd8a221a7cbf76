"""``MultiWorkerMirroredStrategy``: synchronous replicas on the devices of several processes.

Each process (a TF "worker") runs the same program. ``jax.distributed`` joins
them (its coordinator is the chief, else worker 0; process ids put the chief
first), and one mesh spans every process's devices: the compiled engine,
variables and reductions are MirroredStrategy's, with each process holding its
own rows of the global arrays.
"""

import enum
import json
import logging
import numbers
import warnings

import jax
import jax.numpy as jnp

from keras_dist import _context
from keras_dist import _distributed_runtime
from keras_dist._peer_watch import PeerWatch
from keras_dist._reduce_op import ReduceOp
from keras_dist.cluster_resolver import ClusterSpec
from keras_dist.cluster_resolver import SimpleClusterResolver
from keras_dist.cluster_resolver import TFConfigClusterResolver
from keras_dist.cluster_resolver import resolve_cluster
from keras_dist.cluster_resolver._multi_worker import id_in_cluster
from keras_dist.cluster_resolver._multi_worker import worker_count
from keras_dist.cluster_resolver._role import ProcessRole
from keras_dist.strategies._mesh_extended import MeshExtended
from keras_dist.strategies._strategy import Strategy

_log = logging.getLogger(__name__)

# How long a process waits for its peers at start-up and, by default, in a step.
_DEFAULT_TIMEOUT_SECONDS = 600


class CommunicationImplementation(enum.Enum):
    """Which collective implementation to use (TF's names, mapped onto JAX's).

    * ``AUTO``: gloo between CPU processes, NCCL between GPUs (JAX's choices).
    * ``RING``: gloo's ring algorithms on CPU. On GPUs JAX always uses NCCL.
    * ``NCCL``: NCCL; needs GPUs. On CPU it falls back to gloo with a warning,
      as TF falls back to RING.

    ``CollectiveCommunication`` is TF's older name for it.

    >>> import keras_dist as kd
    >>> options = kd.experimental.CommunicationOptions(
    ...     implementation=kd.experimental.CommunicationImplementation.RING)
    >>> options.implementation.name
    'RING'
    >>> kd.experimental.CollectiveCommunication is kd.experimental.CommunicationImplementation
    True
    """

    AUTO = "AUTO"
    RING = "RING"
    NCCL = "NCCL"


CollectiveCommunication = CommunicationImplementation  # TF's older name


class CommunicationOptions:
    """Options for the collectives of a multi-worker strategy.

    Args:
        bytes_per_pack: accepted for compatibility; XLA packs collectives itself.
        timeout_seconds: how long a step may wait for its peers before the
            survivors raise ``DeadlineExceededError`` naming the missing task.
            ``None`` means the default, 600 s. Also the start-up timeout.
        implementation: a ``CommunicationImplementation`` (or its name).

    >>> import keras_dist as kd
    >>> kd.experimental.CommunicationOptions(timeout_seconds=30).timeout_seconds
    30
    """

    def __init__(
        self,
        bytes_per_pack=0,
        timeout_seconds=None,
        implementation=CommunicationImplementation.AUTO,
    ):
        if not isinstance(bytes_per_pack, numbers.Integral) or isinstance(bytes_per_pack, bool):
            raise TypeError(
                "bytes_per_pack must be a non-negative integer (0 lets XLA choose). "
                f"Received: bytes_per_pack={bytes_per_pack!r}"
            )
        if bytes_per_pack < 0:
            raise ValueError(
                "bytes_per_pack must be a non-negative integer (0 lets XLA choose). "
                f"Received: bytes_per_pack={bytes_per_pack!r}"
            )
        if timeout_seconds is not None and (
            not isinstance(timeout_seconds, numbers.Real) or isinstance(timeout_seconds, bool)
        ):
            raise TypeError(
                "timeout_seconds must be a positive number of seconds, or None. "
                f"Received: timeout_seconds={timeout_seconds!r}"
            )
        if timeout_seconds is not None and not timeout_seconds > 0:
            raise ValueError(
                "timeout_seconds must be a positive number of seconds, or None. "
                f"Received: timeout_seconds={timeout_seconds!r}"
            )
        if isinstance(implementation, str):
            name = implementation.upper()
            if name not in CommunicationImplementation.__members__:
                raise ValueError(
                    "implementation must be the name of a CommunicationImplementation "
                    "(AUTO, RING or NCCL), or one of its members, e.g. "
                    "kd.experimental.CommunicationImplementation.RING. Received: "
                    f"implementation={implementation!r}"
                )
            implementation = CommunicationImplementation[name]
        if not isinstance(implementation, CommunicationImplementation):
            raise TypeError(
                "implementation must be a CommunicationImplementation (AUTO, RING or "
                "NCCL) or its name as a string, e.g. "
                "kd.experimental.CommunicationImplementation.RING or 'RING'. Received: "
                f"implementation={implementation!r}"
            )
        self.bytes_per_pack = bytes_per_pack
        self.timeout_seconds = timeout_seconds
        self.implementation = implementation

    def __repr__(self):
        return (
            f"CommunicationOptions(bytes_per_pack={self.bytes_per_pack}, "
            f"timeout_seconds={self.timeout_seconds}, "
            f"implementation={self.implementation.name})"
        )


class CollectiveHints:
    """Deprecated: TF's older name of ``CommunicationOptions``; use that instead.

    Calling it warns (``DeprecationWarning``) and returns a
    ``CommunicationOptions`` with the same ``bytes_per_pack`` and
    ``timeout_seconds``, so it goes wherever ``CommunicationOptions`` goes,
    e.g. ``kd.MultiWorkerMirroredStrategy(communication_options=...)``.

    >>> import warnings
    >>> import keras_dist as kd
    >>> with warnings.catch_warnings(record=True) as caught:
    ...     warnings.simplefilter("always")
    ...     options = kd.experimental.CollectiveHints(timeout_seconds=30)
    >>> options
    CommunicationOptions(bytes_per_pack=0, timeout_seconds=30, implementation=AUTO)
    >>> caught[0].category.__name__
    'DeprecationWarning'
    """

    def __new__(cls, bytes_per_pack=0, timeout_seconds=None) -> CommunicationOptions:
        warnings.warn(
            "kd.experimental.CollectiveHints is deprecated: use "
            "kd.experimental.CommunicationOptions(bytes_per_pack=..., timeout_seconds=...) "
            "instead.",
            DeprecationWarning,
            stacklevel=2,
        )
        return CommunicationOptions(bytes_per_pack=bytes_per_pack, timeout_seconds=timeout_seconds)


class _ProcessLayout:
    """Where this process sits in the cluster, read from a cluster resolver."""

    def __init__(self, resolver):
        spec = ClusterSpec(resolver.cluster_spec())
        self.cluster_spec = spec
        self.task_type = resolver.task_type
        self.task_id = resolver.task_id
        jobs = set(spec.jobs) & {"chief", "worker"}
        if not jobs or self.task_type == "evaluator":
            # One process, or TF's evaluator, which is not part of the collective.
            self.num_workers, self.process_id, self.coordinator = 1, 0, None
            return
        if self.task_type is None or self.task_id is None:
            raise ValueError(
                "When `cluster_spec` is given, you must also specify `task_type` and "
                f"`task_id`. Received: cluster_spec={spec.as_dict()}, "
                f"task_type={self.task_type!r}, task_id={self.task_id!r}"
            )
        if self.task_type not in ("chief", "worker"):
            raise ValueError(
                "MultiWorkerMirroredStrategy runs on 'chief' and 'worker' tasks only "
                f"(ParameterServerStrategy uses 'ps'). Received: task_type={self.task_type!r}"
            )
        self.num_workers = worker_count(spec.as_dict(), self.task_type)
        self.process_id = id_in_cluster(spec.as_dict(), self.task_type, self.task_id)
        coordinator = getattr(resolver, "coordinator_address", None)
        if not coordinator:
            job = "chief" if "chief" in jobs else "worker"
            coordinator = spec.task_address(job, 0)
        self.coordinator = coordinator

    def collective_jobs(self) -> str:
        """The chief and worker jobs as JSON: what every worker must have been given alike."""
        spec = self.cluster_spec.as_dict()
        return json.dumps({job: spec[job] for job in ("chief", "worker") if job in spec})

    @property
    def role(self) -> ProcessRole:
        """This process's role (who is the chief is decided in ``cluster_resolver``)."""
        if self.num_workers == 1 and self.task_type is None:
            return ProcessRole()
        return ProcessRole(self.task_type, self.task_id, self.cluster_spec)

    @property
    def is_chief(self) -> bool:
        return self.role.is_chief

    def task_names(self) -> list:
        """``"chief 0"``, ``"worker 1"``... in process-id order."""
        spec = self.cluster_spec.as_dict()
        names = [f"chief {i}" for i in sorted(_indices(spec.get("chief", [])))]
        names += [f"worker {i}" for i in sorted(_indices(spec.get("worker", [])))]
        return names


def _indices(tasks):
    return tasks.keys() if isinstance(tasks, dict) else range(len(tasks))


class MultiWorkerExtended(MeshExtended):
    """MirroredStrategy's extended API over a mesh spanning every worker's devices."""

    def __init__(self, container_strategy, layout, options):
        self._layout = layout
        self._options = options
        timeout = options.timeout_seconds or _DEFAULT_TIMEOUT_SECONDS
        if layout.num_workers > 1:
            _distributed_runtime.initialize(
                layout.coordinator,
                layout.num_workers,
                layout.process_id,
                timeout_seconds=timeout,
                # JAX picks NCCL between GPUs itself; CPU processes need gloo.
                collectives="gloo",
                # Process 0 hosts the coordinator: the chief, else worker 0.
                task_names=layout.task_names(),
                cluster=layout.collective_jobs(),
            )
        local = tuple(jax.local_devices())
        everyone = tuple(sorted(jax.devices(), key=lambda d: (d.process_index, d.id)))
        # Workers may differ in device count (2 GPUs here, 4 there): the mesh
        # holds every device, and each worker feeds its own replicas' rows.
        if (
            options.implementation is CommunicationImplementation.NCCL
            and local[0].platform == "cpu"
        ):
            _log.warning(
                "CommunicationImplementation.NCCL needs GPUs; these workers run on "
                "CPU, so collectives use gloo (TF falls back to RING the same way)."
            )
        dispatch = None
        if everyone != local:
            # On CPU each execution ends before the next is dispatched anyway (one
            # in flight); dispatching it through the watch, which waits with a
            # deadline, means a lost peer is reported by name instead of hanging
            # this or a later read. ``fit``'s host work overlaps the running step.
            presence = _distributed_runtime.presence()
            watch = PeerWatch(layout.task_names(), layout.process_id, timeout, presence)
            dispatch = watch.dispatch
        super().__init__(container_strategy, local, mesh_devices=everyone, dispatch=dispatch)
        if layout.num_workers > 1:  # TF's line, which names this task in every worker's log
            self._log_layout(layout, local, options)

    @staticmethod
    def _log_layout(layout, local, options):
        _log.info(
            "MultiWorkerMirroredStrategy: this process is %s (process %d of %d), "
            "coordinator %s, local devices %s, communication %s",
            layout.task_names()[layout.process_id],
            layout.process_id,
            layout.num_workers,
            layout.coordinator,
            [str(d) for d in local],
            options.implementation,
        )

    @property
    def layout(self):
        """The cluster as this worker sees it (workers, this task, the coordinator)."""
        return self._layout

    @property
    def num_workers(self) -> int:
        return self._layout.num_workers

    @property
    def worker_index(self) -> int:
        return self._layout.process_id

    @property
    def role(self) -> ProcessRole:
        """The chief (worker 0 without one) writes checkpoints and summaries."""
        return self._layout.role

    def reduce_non_distributed(self, reduce_op, value):
        """A plain value is this worker's: SUM adds it over workers, as TF does.

        (Spec: two workers reducing a host tensor 1 with SUM get 2.) Inside a
        compiled program the value is a constant of the trace and keeps the
        one-process rule.
        """
        traced = isinstance(value, jax.core.Tracer) or _context.current_frame().engine is not None
        if not self.spans_processes or reduce_op is ReduceOp.MEAN or traced:
            return super().reduce_non_distributed(reduce_op, value)
        return self.placement.cross_process_sum(jnp.asarray(value))

    @property
    def experimental_between_graph(self) -> bool:
        return True

    @property
    def worker_devices(self) -> tuple:
        """This worker's devices, as TF names them (``/job:worker/replica:0/task:1/...``)."""
        task_type = self._layout.task_type or "localhost"
        task_id = self._layout.task_id or 0
        return tuple(
            f"/job:{task_type}/replica:0/task:{task_id}/device:{d.platform.upper()}:{i}"
            for i, d in enumerate(self.local_devices)
        )


class MultiWorkerMirroredStrategy(Strategy):
    """Synchronous training on the devices of several processes (TF's "workers").

    Every process runs the same program. The cluster comes from
    ``cluster_resolver`` or the environment (``TF_CONFIG``, Keras's
    ``KERAS_DISTRIBUTION_*``, Kubeflow's JAX variables, Slurm); without one it
    is a single worker using the local devices. Start a local cluster with
    ``keras-dist launch --workers 2 train.py`` or ``kd.launch(fn, num_workers=2)``.

    Create the strategy at the top of the program, before anything uses JAX:
    it starts JAX's multi-process runtime.

    Args:
        cluster_resolver: a ``kd.cluster_resolver.ClusterResolver``.
        communication_options: a ``CommunicationOptions``.

    >>> import keras_dist as kd
    >>> strategy = kd.MultiWorkerMirroredStrategy()  # no cluster: one worker
    >>> strategy.extended.should_checkpoint
    True
    """

    def __init__(self, cluster_resolver=None, communication_options=None):
        if communication_options is None:
            communication_options = CommunicationOptions()
        if not isinstance(communication_options, CommunicationOptions):
            raise TypeError(
                "communication_options must be a kd.experimental.CommunicationOptions. "
                f"Received: communication_options={communication_options!r}"
            )
        resolver = cluster_resolver or resolve_cluster()
        if resolver is None and _distributed_runtime.is_initialized():
            # jax.distributed was started by hand: its processes are the workers.
            workers = ClusterSpec({"worker": [""] * jax.process_count()})
            task_id = jax.process_index()
            resolver = SimpleClusterResolver(workers, task_type="worker", task_id=task_id)
        resolver = resolver or TFConfigClusterResolver(environ={})
        layout = _ProcessLayout(resolver)
        self._cluster_resolver = resolver
        super().__init__(MultiWorkerExtended(self, layout, communication_options))

    @property
    def cluster_resolver(self):
        """The resolver describing the cluster and this task."""
        return self._cluster_resolver

    def __repr__(self):
        layout = self._extended.layout
        return (
            f"MultiWorkerMirroredStrategy(workers={layout.num_workers}, "
            f"task={layout.task_type}:{layout.task_id}, "
            f"devices={list(self._extended.worker_devices)})"
        )


class ExperimentalMultiWorkerMirroredStrategy(MultiWorkerMirroredStrategy):
    """``tf.distribute.experimental.MultiWorkerMirroredStrategy``: takes ``communication``.

    >>> import keras_dist as kd
    >>> s = kd.experimental.MultiWorkerMirroredStrategy(
    ...     communication=kd.experimental.CommunicationImplementation.RING)
    >>> s.num_replicas_in_sync >= 1
    True
    """

    def __init__(
        self,
        communication=CommunicationImplementation.AUTO,
        cluster_resolver=None,
        communication_options=None,
    ):
        if communication_options is None:
            communication_options = CommunicationOptions(implementation=communication)
        super().__init__(cluster_resolver, communication_options)
