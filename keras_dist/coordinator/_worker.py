"""One worker as the coordinator sees it: a thread that runs closures on it.

The thread takes a closure, makes sure the worker has what it needs (the
program, the per-worker datasets and iterators it reads) and asks it to run.
A worker that cannot be reached gives its closure back to the queue (another
worker runs it) and is probed until it answers again; then everything it had
is sent again: a restarted worker rebuilds its datasets. A lost ps task is
fatal, as in TF: the error reaches ``join``/``schedule``.
"""

import threading
import time

import cloudpickle

from keras_dist import errors
from keras_dist._ps._transport import RpcClient

RUN_TIMEOUT = 600.0
PROBE_INTERVAL = 0.5


class ClosureInputError(errors.OpError):
    """A scheduled function's input (a per-worker dataset) failed on its worker.

    >>> import keras_dist as kd
    >>> issubclass(kd.coordinator.ClosureInputError, kd.errors.OpError)
    True
    """


def _ps_tasks(error: errors.OpError) -> list:
    return [t for t in error.lost_tasks if t.startswith("/job:ps/")]


class WorkerThread:
    """Runs closures from ``queue`` on worker ``index`` at ``address``."""

    def __init__(self, index: int, address: str, queue, alive):
        self.index = index
        self.name = f"/job:worker/replica:0/task:{index}"
        self.client = RpcClient(address, name=self.name)
        self._queue = queue
        self._alive = alive  # returns False once the coordinator is gone
        self._sent: set = set()  # programs, datasets and iterators this worker has
        self.available = True
        self._thread = threading.Thread(target=self._loop, name=f"kd-{self.name}", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while self._alive() and not self._queue.stopped:
            closure = self._queue.get(timeout=0.5)
            if closure is None:
                continue
            try:
                value = self._run(closure.call)
            except errors.OpError as error:
                if error.lost_tasks == (self.name,) and isinstance(
                    error, (errors.UnavailableError, errors.DeadlineExceededError)
                ):
                    self._queue.put_back(closure)
                    self._wait_until_back()
                    continue
                if _ps_tasks(error):
                    error = errors.UnavailableError(
                        f"Parameter server {', '.join(_ps_tasks(error))} is unavailable: "
                        f"{error.message}",
                        _ps_tasks(error),
                    )
                self._queue.mark_failed(closure, error)
            except Exception as error:  # noqa: BLE001 - a coordinator bug; reported, not hung
                self._queue.mark_failed(closure, error)
            else:
                # The queue sets the value, or the cancellation of an error that
                # came while this closure ran, under its lock.
                self._queue.mark_finished(closure, value)

    def _wait_until_back(self) -> None:
        """Probes the worker until it answers; it then gets everything sent again."""
        self.available = False
        while self._alive() and not self._queue.stopped:
            try:
                self.client.call({"op": "ping"}, timeout=2.0)
            except errors.OpError:
                time.sleep(PROBE_INTERVAL)
                continue
            break
        self._sent.clear()
        self.available = True

    def _run(self, call):
        program = call.program
        for attempt in range(2):
            try:
                self._ensure(call)
                header = {
                    "op": "run",
                    "program_id": program.program_id,
                    "worker_index": self.index,
                    "iterators": [[it.iterator_id, count] for it, count in call.iterators],
                    "epoch": call.epoch,
                }
                _, results, _ = self.client.call(
                    header, call.arrays_for(self.index), timeout=RUN_TIMEOUT
                )
                return program.results(results)
            except errors.NotFoundError as error:
                # The worker restarted between two calls: send everything again.
                if attempt or error.lost_tasks != (self.name,):
                    raise
                self._sent.clear()

    def _ensure(self, call) -> None:
        program = call.program
        if program.program_id not in self._sent:
            self.client.call(program.header(), (), program.blob, timeout=RUN_TIMEOUT)
            self._sent.add(program.program_id)
        for iterator, _ in call.iterators:
            dataset = iterator.dataset
            if dataset.dataset_id not in self._sent:
                header = {"op": "dataset", "dataset_id": dataset.dataset_id}
                header["worker_index"] = self.index
                try:
                    blob = cloudpickle.dumps(dataset.dataset_fn)
                    self.client.call(header, (), blob, timeout=RUN_TIMEOUT)
                except errors.OpError as error:
                    if error.lost_tasks == (self.name,):
                        raise
                    raise ClosureInputError(
                        f"The per-worker dataset failed on {self.name}: {error.message}"
                    ) from error
                self._sent.add(dataset.dataset_id)
            if iterator.iterator_id not in self._sent:
                header = {"op": "iterator", "dataset_id": dataset.dataset_id}
                header["iterator_id"] = iterator.iterator_id
                self.client.call(header, timeout=RUN_TIMEOUT)
                self._sent.add(iterator.iterator_id)
