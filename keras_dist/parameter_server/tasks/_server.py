"""``kd.Server``: one task's gRPC server (``tf.distribute.Server``).

A ``ps`` task's server holds variables and applies updates; a ``worker``
(or ``chief``) task's server runs the programs the coordinator sends. Servers
may run in the process that uses them (TF's parameter-server tutorial builds
its whole cluster in a notebook), or one per process, started from TF_CONFIG.
"""

import logging
import threading

import jax

from keras_dist.cluster_resolver import ClusterResolver
from keras_dist.cluster_resolver import ClusterSpec
from keras_dist.parameter_server.rpc import _protocol as protocol
from keras_dist.parameter_server.rpc._auth import token_from_environment
from keras_dist.parameter_server.rpc._transport import RpcServer
from keras_dist.parameter_server.tasks._memory import is_own_task
from keras_dist.parameter_server.tasks._memory import keep_freed_buffers
from keras_dist.parameter_server.tasks._store import VariableStore
from keras_dist.parameter_server.tasks._worker_service import WorkerService

logger = logging.getLogger("keras_dist.ps")

_JOBS = ("ps", "worker", "chief", "evaluator")

# Started servers stay alive until stopped, even when no one keeps the object
# (TF's tutorial starts servers without keeping them).
_RUNNING: set = set()


def _cluster_spec(cluster_spec_or_resolver) -> ClusterSpec:
    if isinstance(cluster_spec_or_resolver, ClusterResolver):
        return ClusterSpec(cluster_spec_or_resolver.cluster_spec())
    return ClusterSpec(cluster_spec_or_resolver)


class Server:
    """An in-process server for one task of a cluster, as ``tf.distribute.Server``.

    Args:
        cluster_spec_or_resolver: a ``ClusterSpec``, its dict, or a cluster resolver.
        job_name: ``"ps"``, ``"worker"``, ``"chief"`` or ``"evaluator"``; with a
            resolver, its ``task_type`` by default.
        task_index: the task's index in its job; the resolver's ``task_id`` by default.
        protocol: ``"grpc"`` (the only one).
        config: accepted for TF compatibility; unused.
        start: start serving at once.
        credentials: ``grpc.ssl_server_credentials(...)`` to serve over TLS. Use
            TLS whenever the tasks talk over a network others can reach:
            the cluster token (``KERAS_DIST_CLUSTER_TOKEN``) travels with every
            request and would be readable in plain text.

    The server listens at the address the cluster spec gives the task and
    nowhere else.

    >>> import keras_dist as kd
    >>> port = kd.testing.pick_unused_port()
    >>> server = kd.Server({"ps": [f"127.0.0.1:{port}"], "worker": ["127.0.0.1:1"]},
    ...                    job_name="ps", task_index=0)
    >>> server.target == f"grpc://127.0.0.1:{port}"
    True
    >>> server.stop()
    """

    def __init__(
        self,
        cluster_spec_or_resolver,
        job_name=None,
        task_index=None,
        protocol="grpc",
        config=None,
        start=True,
        credentials=None,
    ):
        if protocol not in (None, "grpc"):
            raise ValueError(
                f'keras_dist servers speak gRPC only: pass protocol="grpc". Received: '
                f"protocol={protocol!r}"
            )
        resolver = cluster_spec_or_resolver
        if isinstance(resolver, ClusterResolver):
            job_name = job_name if job_name is not None else resolver.task_type
            task_index = task_index if task_index is not None else resolver.task_id
        spec = _cluster_spec(cluster_spec_or_resolver)
        if job_name not in _JOBS or job_name not in spec.jobs:
            raise ValueError(
                f"`job_name` must be one of the cluster's jobs among {list(_JOBS)}. "
                f"Received: job_name={job_name!r}, jobs={spec.jobs}"
            )
        task_index = 0 if task_index is None else int(task_index)
        self.cluster_spec = spec
        self.job_name = job_name
        self.task_index = task_index
        self.task_name = f"/job:{job_name}/replica:0/task:{task_index}"
        address = spec.task_address(job_name, task_index)
        # TF_CONFIG names this task: a process of its own (not an in-process cluster).
        self._own_process = is_own_task(job_name, task_index)
        if job_name == "ps":
            self._service = VariableStore(self.task_name)
        else:
            workers = spec.num_tasks("worker") if "worker" in spec.jobs else 1
            # A worker task of its own process runs each step on all its devices, the
            # batch split between them (as a between-graph worker does). Servers of an
            # in-process cluster share the coordinator's devices: they use one.
            devices = jax.local_devices() if self._own_process else ()
            self._service = WorkerService(
                self.task_name, spec, workers, credentials=None, devices=devices
            )
        self._rpc = RpcServer(address, self._handle, name=self.task_name, credentials=credentials)
        self._address = address
        self._started = False
        if start:
            self.start()

    @property
    def target(self) -> str:
        """The server's address, ``grpc://host:port``."""
        return f"grpc://{self._address}"

    @property
    def service(self):
        """What the server serves: a ``VariableStore`` (ps) or a ``WorkerService``."""
        return self._service

    @property
    def refused_requests(self) -> int:
        """How many requests were refused for lacking the cluster token."""
        return self._rpc.refused

    def start(self) -> None:
        """Starts serving (once)."""
        if self._started:
            return
        own_process = self._own_process
        if not token_from_environment():
            # A task of its own process (TF_CONFIG names it) is surely called from
            # others, which it will refuse: say so here, not only in their errors.
            logger.log(
                logging.WARNING if own_process else logging.INFO,
                "%s starts without KERAS_DIST_CLUSTER_TOKEN: it made a token of its own, so "
                "only clients in this process can call it and every other task will be "
                "refused. Set the same KERAS_DIST_CLUSTER_TOKEN on every task (keras-dist "
                "launch does).",
                self.task_name,
            )
        if self.job_name in ("ps", "worker") and own_process:
            keep_freed_buffers()  # a process of its own: each step's buffers are reused
        self._rpc.start()
        self._started = True
        _RUNNING.add(self)

    def join(self) -> None:
        """Blocks until the server stops (TF's ``join``: a ps task serves until the job ends).

        The job ends when the chief's program does: it sends every ps and worker
        task a ``stop`` request (``keras_dist.parameter_server._job``), and
        ``join`` returns.
        """
        self._rpc.wait()

    def stop(self) -> None:
        """Stops serving; in-process test clusters call this to simulate a lost task."""
        self._stop(grace=None)

    def _handle(self, header: dict, arrays: list, blob: bytes):
        """The service's answer, or, for ``stop``, a reply now and the server stopped after it."""
        if header.get("op") != protocol.STOP.name:
            return self._service.handle(header, arrays, blob)
        protocol.check_request(header, "ps" if self.job_name == "ps" else "worker")
        logger.info("%s stops: the chief's program ended", self.task_name)
        # Stopping waits for calls in flight, this one included: not from its own thread.
        threading.Thread(target=self._stop, args=(5.0,), name="kd-server-stop", daemon=True).start()
        return {"task": self.task_name}, [], b""

    def _stop(self, grace) -> None:
        self._rpc.stop(grace=grace)
        self._started = False
        _RUNNING.discard(self)
        close = getattr(self._service, "close", None)
        if close is not None:
            close()
