"""One worker as the coordinator sees it: a thread that runs closures on it.

The thread takes a closure (or a few queued closures of one program), makes
sure the worker has what it needs (the program, the per-worker datasets and
iterators it reads) and asks it to run them, in one request. A worker that
cannot be reached gives its closures back to the queue (another worker runs
them; each call's step is applied on the ps tasks once, by its ``run_id``)
and is probed until it answers again; then everything it had is sent again:
a restarted worker rebuilds its datasets. A lost ps
task is fatal, as in TF: the error reaches ``join``/``schedule``.
"""

import threading
import time

from keras_dist import errors
from keras_dist.parameter_server.rpc import _protocol as protocol
from keras_dist.parameter_server.rpc._transport import RpcClient
from keras_dist.parameter_server.rpc._transport import raise_if_error

RUN_TIMEOUT = 600.0
PROBE_INTERVAL = 0.5
# Closures of one program queued together go to a worker in one request (up
# to this many, and a fair share of the queue): the worker runs them one
# after the other, and a step does not pay its own round trip from here.
# The worker idles from one reply to the next request: 16 (not 4) took the
# coordinator's share of a step from 0.25 to 0.10 ms of CPU and the benchmark
# from about 0.9 to about 1.0 of the raw-gRPC baseline on a 2-core machine.
RUNS_PER_REQUEST = 16


class ClosureInputError(errors.OpError):
    """A scheduled function's input (a per-worker dataset) failed on its worker.

    >>> import keras_dist as kd
    >>> issubclass(kd.coordinator.ClosureInputError, kd.errors.OpError)
    True
    """


class PsVersions:
    """The newest version of each ps task that a finished call reported.

    A worker starts a call from the values its last call got back only while
    they are at least these versions (``WorkerService._variable_values``): a
    function scheduled after another one finished reads that one's writes,
    even on a worker that sat idle meanwhile.

    >>> versions = PsVersions()
    >>> versions.seen([[0, 5], [1, 2]]); versions.seen([[0, 3]])
    >>> versions.newest()
    [[0, 5], [1, 2]]
    """

    def __init__(self):
        self._newest: dict = {}
        self._lock = threading.Lock()

    def seen(self, versions) -> None:
        """Notes ``[[task, version]]`` from a worker's reply."""
        with self._lock:
            for task, version in versions:
                self._newest[task] = max(version, self._newest.get(task, version))

    def newest(self) -> list:
        """``[[task, version]]``, as a call's ``fresh`` field."""
        with self._lock:
            return [[task, version] for task, version in sorted(self._newest.items())]


def _ps_tasks(error: errors.OpError) -> list:
    return [t for t in error.lost_tasks if t.startswith("/job:ps/")]


class WorkerThread:
    """Runs closures from ``queue`` on worker ``index`` of ``num_workers`` at ``address``."""

    def __init__(
        self, index, address: str, queue, alive, num_workers: int = 1, programs=None, versions=None
    ):
        self.index = index
        self.name = f"/job:worker/replica:0/task:{index}"
        self.client = RpcClient(address, name=self.name)
        self._queue = queue
        self._alive = alive  # returns False once the coordinator is gone
        self._num_workers = num_workers
        self._sent: set = set()  # programs, datasets and iterators this worker has
        self._programs = programs  # the ProgramCache: which programs were freed
        self._versions = versions if versions is not None else PsVersions()  # shared by all
        self.available = True
        self._thread = threading.Thread(target=self._loop, name=f"kd-{self.name}", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while self._alive() and not self._queue.stopped:
            if self._run_next():
                # Waited for here, not inside ``_run_next``: while the worker is
                # away the thread holds nothing of the closures it gave back (a
                # call keeps its variables, and so a dropped model, alive).
                self._wait_until_back()

    def _run_next(self) -> bool:
        """Runs the next closures; whether the worker was lost (its closures given back)."""
        # A method of its own: while the thread waits for the next closures, it
        # holds nothing of the last ones (a call keeps its variables alive).
        closures = self._queue.get_many(0.5, RUNS_PER_REQUEST, self._num_workers)
        if not closures:
            return False
        values, error = self._run_many([closure.call for closure in closures])
        # The queue sets each value, or the cancellation of an error that
        # came while the closure ran, under its lock.
        for closure, value in zip(closures, values):
            self._queue.mark_finished(closure, value)
        return error is not None and self._failed(closures[len(values) :], error)

    def _failed(self, closures, error) -> bool:
        """``closures[0]`` failed with ``error``; the others did not run.

        Returns whether the worker was lost: its closures then went back to the
        queue, and the caller waits until the worker answers again.
        """
        if (
            isinstance(error, errors.OpError)
            and error.lost_tasks == (self.name,)
            and isinstance(error, (errors.UnavailableError, errors.DeadlineExceededError))
        ):
            # The worker is lost: all of them run on another worker. Those it
            # finished before it was lost are not applied again (their run ids).
            for closure in reversed(closures):
                self._queue.put_back(closure)
            return True
        if isinstance(error, errors.OpError) and _ps_tasks(error):
            error = errors.UnavailableError(
                f"Parameter server {', '.join(_ps_tasks(error))} is unavailable: {error.message}",
                _ps_tasks(error),
            )
        self._queue.mark_failed(closures[0], error)
        for closure in closures[1:]:
            self._queue.put_back(closure)  # cancelled by that error, as TF's queue does
        return False

    def _wait_until_back(self) -> None:
        """Probes the worker until it answers; it then gets everything sent again."""
        self.available = False
        while self._alive() and not self._queue.stopped:
            try:
                self.client.call(protocol.request(protocol.PING), timeout=2.0)
            except errors.OpError:
                time.sleep(PROBE_INTERVAL)
                continue
            break
        self._forget_sent()
        self.available = True

    def _run_many(self, calls) -> tuple:
        """``(values, error)``: the results of the calls that ran, and why the next did not."""
        values, resent = [], False
        while len(values) < len(calls):
            try:
                done, error = self._request(calls[len(values) :])
            except Exception as lost:  # noqa: BLE001 - a lost worker, or a coordinator bug
                return values, lost
            values += done
            if error is None:
                break
            if (
                isinstance(error, errors.NotFoundError)
                and error.lost_tasks == (self.name,)
                and not resent
            ):
                # The worker restarted between two calls: send everything again.
                resent = True
                self._forget_sent()
                continue
            return values, error
        return values, None

    def _request(self, calls) -> tuple:
        """Runs ``calls`` on the worker in one request; ``(values, error)`` as ``_run_many``."""
        ready, failure = [], None
        for call in calls:
            try:
                self._ensure(call)
            except Exception as error:  # noqa: BLE001 - this call's failure: those before run
                failure = error
                break
            ready.append(call)
        if not ready:
            return [], failure
        calls = ready
        headers, arrays = [], []
        fresh = self._versions.newest()
        for call in calls:
            arguments = call.arrays_for(self.index)
            headers.append(
                protocol.request(
                    protocol.RUN,
                    program_id=call.program.program_id,
                    worker_index=self.index,
                    iterators=[[it.iterator_id, count] for it, count in call.iterators],
                    epoch=call.epoch,
                    fresh=fresh,
                    n_arrays=len(arguments),
                    run_id=call.run_id,
                )
            )
            arrays += arguments
        reply, results, _ = self.client.call(
            protocol.request(protocol.RUN_MANY, calls=headers, unload=self._freed_programs()),
            arrays,
            timeout=RUN_TIMEOUT * len(calls),
        )
        # Before the closures' values are set: a function scheduled once one is
        # fetched starts from these versions (or newer) on every worker.
        self._versions.seen(reply.get("versions", ()))
        values, position = [], 0
        for call, count in zip(calls, reply["counts"]):
            values.append(call.program.results(results[position : position + count]))
            position += count
        if reply["failed"] is not None:
            try:
                raise_if_error(reply["failed"])
            except errors.OpError as error:
                return values, error
        return values, failure

    def _forget_sent(self) -> None:
        """The worker restarted: it has none of what it was sent (it gets it again)."""
        if self._programs is not None:
            self._programs.unloaded(list(self._sent), self.index)
        self._sent.clear()

    def _freed_programs(self) -> list:
        """Programs this worker loaded that the coordinator freed: it drops them now."""
        if self._programs is None:
            return []
        # Iterates this worker's few loaded ids, not every program ever freed.
        freed = sorted(i for i in self._sent if i in self._programs.dropped)
        self._sent.difference_update(freed)
        self._programs.unloaded(freed, self.index)
        return freed

    def _ensure(self, call) -> None:
        program = call.program
        if program.program_id not in self._sent:
            self.client.call(program.header(), (), program.blob, timeout=RUN_TIMEOUT)
            self._sent.add(program.program_id)
            if self._programs is not None:
                self._programs.loaded(program.program_id, self.index)
        for iterator, _ in call.iterators:
            dataset = iterator.dataset
            if dataset.dataset_id not in self._sent:
                header = protocol.request(
                    protocol.DATASET, dataset_id=dataset.dataset_id, worker_index=self.index
                )
                try:
                    self.client.call(header, (), dataset.pickled_fn, timeout=RUN_TIMEOUT)
                except errors.OpError as error:
                    if error.lost_tasks == (self.name,):
                        raise
                    raise ClosureInputError(
                        f"The per-worker dataset failed on {self.name}: {error.message}"
                    ) from error
                self._sent.add(dataset.dataset_id)
            if iterator.iterator_id not in self._sent:
                header = protocol.request(
                    protocol.ITERATOR,
                    dataset_id=dataset.dataset_id,
                    iterator_id=iterator.iterator_id,
                )
                self.client.call(header, timeout=RUN_TIMEOUT)
                self._sent.add(iterator.iterator_id)
