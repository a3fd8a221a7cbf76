"""``ClusterCoordinator``: schedules functions onto the workers of a parameter-server cluster."""

import inspect
import threading
import time
import weakref

import jax

from keras_dist import errors
from keras_dist._capabilities import DistributionStrategy
from keras_dist._capabilities import RemoteScheduling
from keras_dist._input import InputContext
from keras_dist.parameter_server.scheduling._closure_queue import Closure
from keras_dist.parameter_server.scheduling._closure_queue import ClosureQueue
from keras_dist.parameter_server.scheduling._per_worker import PerWorkerDataset
from keras_dist.parameter_server.scheduling._per_worker import PerWorkerValues
from keras_dist.parameter_server.scheduling._per_worker import element_spec_of
from keras_dist.parameter_server.scheduling._remote_value import RemoteValue
from keras_dist.parameter_server.scheduling._worker_thread import PsVersions
from keras_dist.parameter_server.scheduling._worker_thread import WorkerThread
from keras_dist.parameter_server.variables._trace import ProgramTrace
from keras_dist.parameter_server.variables._trace import current_worker_index
from keras_dist.parameter_server.variables._trace import on_worker
from keras_dist.parameter_server.variables._trace import tracing

PS_PROBE_INTERVAL = 2.0
PS_STUCK_AFTER = 30.0  # seconds without an answer before a ps task counts as lost
CLOSURES_PER_WORKER = 1


class ClusterCoordinator:
    """Schedules functions to run on the workers (``tf.distribute.coordinator.ClusterCoordinator``).

    One per strategy: constructing it again returns the same object. ``fn``
    given to ``schedule`` may be any Python function (no ``tf.function``
    needed): it is traced on the coordinator once per input signature and
    the program runs on whichever worker is free.

    >>> import keras, keras_dist as kd
    >>> resolver = kd.testing.create_in_process_cluster(num_workers=2, num_ps=1)
    >>> strategy = kd.ParameterServerStrategy(resolver)
    >>> coordinator = kd.coordinator.ClusterCoordinator(strategy)
    >>> with strategy.scope():
    ...     v = keras.Variable(0.0)
    >>> for _ in range(5):
    ...     _ = coordinator.schedule(lambda: v.assign_add(2.0))
    >>> coordinator.join()
    >>> float(v.numpy())
    10.0
    """

    def __new__(cls, strategy):
        is_strategy = isinstance(strategy, DistributionStrategy)
        if not (is_strategy and isinstance(strategy.extended, RemoteScheduling)):
            raise ValueError(
                "`ClusterCoordinator` works with a `ParameterServerStrategy` only: pass "
                "`kd.ParameterServerStrategy(cluster_resolver)`. "
                f"Received: strategy={strategy!r}"
            )
        extended = strategy.extended
        if extended.coordinator is not None:
            return extended.coordinator
        coordinator = super().__new__(cls)
        coordinator.start(strategy)
        extended.attach_coordinator(coordinator)
        return coordinator

    def __init__(self, strategy):
        pass  # set up once, in __new__ (the coordinator is a singleton per strategy)

    def start(self, strategy) -> None:
        """Starts the workers' threads (called once, when the coordinator is made)."""
        self._strategy = strategy
        self._queue = ClosureQueue()
        spec = strategy.extended.cluster_spec
        this = weakref.ref(self)
        alive = lambda: this() is not None  # noqa: E731 - threads must not hold the coordinator
        addresses = spec.job_tasks("worker")
        self._num_workers = len(addresses)
        # One request in flight per worker, as TF's coordinator: a worker runs
        # its closures in the order they were queued (two in flight measured
        # no faster here, and reordered a lone worker's steps). A request may
        # carry a few closures of one program (``RUNS_PER_REQUEST``).
        versions = PsVersions()  # what finished calls left on the ps tasks: no stale starts
        self._workers = [
            WorkerThread(
                i, address, self._queue, alive, len(addresses), strategy.extended.programs, versions
            )
            for i, address in enumerate(addresses)
            for _ in range(CLOSURES_PER_WORKER)
        ]
        servers = strategy.extended.parameter_servers
        queue = self._queue
        threading.Thread(
            target=_watch_ps, args=(servers, queue, alive), name="kd-ps-watch", daemon=True
        ).start()

    @property
    def strategy(self):
        """The ``ParameterServerStrategy`` this coordinator schedules for."""
        return self._strategy

    def schedule(self, fn, args=(), kwargs=None) -> RemoteValue:
        """Queues ``fn(*args, **kwargs)`` to run on a worker; returns its ``RemoteValue``.

        Raises the error of an earlier function, if one failed since the last
        ``join`` (and clears it). Arguments may be arrays, Python constants,
        ``PerWorkerValues`` and per-worker iterators.
        """
        if not callable(fn):
            raise TypeError(f"`schedule` needs a callable to run on a worker. Received: fn={fn!r}")
        self._queue.done()  # raises a pending error first, as TF's schedule does
        call = self._strategy.extended.programs.call(fn, args, kwargs)
        remote_value = RemoteValue()
        self._queue.put(Closure(call, remote_value))
        return remote_value

    def join(self, timeout: "float | None" = None) -> None:
        """Waits for every scheduled function; raises the first error (then clears it).

        Functions scheduled afterwards read the variables afresh.
        """
        try:
            self._queue.wait(timeout)
        finally:
            self._strategy.extended.new_consistency_epoch()

    def done(self) -> bool:
        """Whether every scheduled function has finished (raises a pending error)."""
        return self._queue.done()

    def fetch(self, val):
        """The values of a nest of ``RemoteValue`` s (waiting for each)."""
        return jax.tree_util.tree_map(
            lambda x: x.fetch() if isinstance(x, RemoteValue) else x,
            val,
            is_leaf=lambda x: isinstance(x, RemoteValue),
        )

    def create_per_worker_dataset(self, dataset_fn) -> PerWorkerDataset:
        """A dataset built on every worker by ``dataset_fn`` (or a dataset to send there).

        ``dataset_fn`` may take an ``InputContext`` and may return what
        ``strategy.distribute_datasets_from_function`` returns. Use
        ``iter()`` of the result as an argument of scheduled functions.
        """
        fn = dataset_fn if callable(dataset_fn) else (lambda: dataset_fn)
        context = InputContext(self._num_workers, 0, 1)
        # Built here once for its element structure, as TF traces it here; a
        # variable created by it raises (the strategy refuses it in a trace).
        with self._strategy.scope(), tracing(ProgramTrace(0)):
            dataset = fn(context) if _takes_argument(fn) else fn()
            build = getattr(dataset, "dataset_for", None)
            if callable(build):
                dataset = build(context)
            try:
                first = next(iter(dataset))
            except StopIteration:
                raise ValueError(
                    "The per-worker dataset is empty on worker 0, so its element structure "
                    f"is unknown. Received: dataset_fn={dataset_fn!r}"
                ) from None
        return PerWorkerDataset(self, fn, element_spec_of(first))

    def create_per_worker_values(self, fn, args=None, kwargs=None) -> PerWorkerValues:
        """``PerWorkerValues`` of ``fn(*args, **kwargs)`` called once per worker (here)."""
        values = []
        for index in range(self._num_workers):
            with on_worker(index):
                values.append(fn(*(args or ()), **(kwargs or {})))
        return PerWorkerValues(values)

    def stop(self) -> None:
        """Stops the workers' threads (queued functions are dropped)."""
        self._queue.stop()

    def __del__(self):
        queue = getattr(self, "_queue", None)
        if queue is not None:
            queue.stop()


def _takes_argument(fn) -> bool:
    """Whether a dataset function takes an ``InputContext`` (or nothing)."""
    try:
        return bool(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        return True


def _watch_ps(servers, queue, alive) -> None:
    """Pings every ps task; a lost one becomes the error ``join``/``schedule`` raise.

    A task that refuses the connection (its process is gone), or stays
    unreachable while the ping reconnects (``RECONNECT_SECONDS``: a link down
    for a few seconds is not a lost task), is lost. One that answers no ping for
    ``PS_STUCK_AFTER`` seconds is lost too; a slower answer is a busy task (a
    loaded machine, a long collection), not a lost one.
    """
    silent_since = {}
    while alive() and not queue.stopped:
        for task in range(servers.num_ps):
            try:
                servers.ping(task, timeout=PS_PROBE_INTERVAL)
                silent_since.pop(task, None)
            except errors.OpError as error:
                if isinstance(error, errors.DeadlineExceededError):
                    since = silent_since.setdefault(task, time.monotonic())
                    if time.monotonic() - since < PS_STUCK_AFTER:
                        continue
                name = servers.clients[task].name
                queue.set_error(
                    errors.UnavailableError(
                        f"Parameter server {name} is unavailable: {error.message}", (name,)
                    )
                )
                return
        time.sleep(PS_PROBE_INTERVAL)


def experimental_get_current_worker_index():
    """The index of the worker running the current scheduled function (or dataset function).

    Raises outside them, as TF does.

    >>> import keras_dist as kd
    >>> kd.coordinator.experimental_get_current_worker_index()
    Traceback (most recent call last):
    ...
    RuntimeError: Cannot find the worker index: ...
    """
    index = current_worker_index()
    if index is None:
        raise RuntimeError(
            "Cannot find the worker index: `experimental_get_current_worker_index` works "
            "inside a function given to `ClusterCoordinator.schedule` or a per-worker "
            "dataset function. Received: a call outside them"
        )
    return index
