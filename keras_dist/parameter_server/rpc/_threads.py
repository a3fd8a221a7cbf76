"""The threads a task's gRPC server runs its requests on.

``concurrent.futures.ThreadPoolExecutor`` joins its threads when the
interpreter exits. A request still open then (a client that went away
mid-call, or one arriving as the process ends) kept a server thread waiting
for its bytes, and the process never exited. These threads are daemon
threads: the process exits, and so do they.
"""

import concurrent.futures
import queue
import threading


class DaemonThreadPool(concurrent.futures.Executor):
    """An executor of up to ``max_workers`` daemon threads, started as work arrives.

    >>> pool = DaemonThreadPool(2, "example")
    >>> pool.submit(sum, [1, 2, 3]).result()
    6
    >>> pool.shutdown()
    """

    def __init__(self, max_workers: int, name: str):
        self._max_workers = max_workers
        self._name = name
        self._work: queue.SimpleQueue = queue.SimpleQueue()
        self._idle = threading.Semaphore(0)
        self._threads: list = []
        self._lock = threading.Lock()
        self._shutdown = False

    def submit(self, fn, /, *args, **kwargs):
        with self._lock:
            if self._shutdown:
                raise RuntimeError(f"The {self._name} threads are shut down: no new work.")
            future = concurrent.futures.Future()
            self._work.put((future, fn, args, kwargs))
            # A thread that is idle takes it; else start one, up to the limit.
            if not self._idle.acquire(blocking=False) and len(self._threads) < self._max_workers:
                thread = threading.Thread(
                    target=self._run, name=f"{self._name}_{len(self._threads)}", daemon=True
                )
                self._threads.append(thread)
                thread.start()
            return future

    def _run(self) -> None:
        while True:
            item = self._work.get()
            if item is None:
                return
            future, fn, args, kwargs = item
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(fn(*args, **kwargs))
                except BaseException as error:  # noqa: BLE001 - handed to the future's owner
                    future.set_exception(error)
            self._idle.release()

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        with self._lock:
            self._shutdown = True
            threads = list(self._threads)
        for _ in threads:
            self._work.put(None)
        if wait:
            for thread in threads:
                thread.join()
