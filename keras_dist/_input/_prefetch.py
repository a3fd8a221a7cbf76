"""`Prefetch`: read an input pipeline ahead, on a background thread.

While a step runs, the next batches are read (and, for distributed datasets,
split and transferred to the devices: ``jax.device_put`` is asynchronous), so
an input pipeline that waits on storage costs little when its waits are no
longer than the steps. The buffer is bounded; errors reach the consumer in
order; closing the iterator (or dropping it) stops the thread.
"""

import queue
import threading

_END = object()
_POLL_SECONDS = 0.1  # how often a blocked producer checks whether it should stop


class Prefetch:
    """Iterates ``iterable`` (through ``transform``) ``buffer_size`` items ahead.

    >>> list(Prefetch(range(5), buffer_size=2))
    [0, 1, 2, 3, 4]
    """

    def __init__(self, iterable, buffer_size: int = 2, transform=None):
        self._stop = threading.Event()
        if buffer_size < 1:
            raise ValueError(f"`buffer_size` must be at least 1. Received: {buffer_size}")
        self._stop = threading.Event()
        self._queue: queue.Queue = queue.Queue(maxsize=buffer_size)
        self._done = False
        self._source, self._transform = iterable, transform
        self._thread = None  # started by the first `next`: nothing is read before it

    def _start(self):
        self._thread = threading.Thread(
            target=self._produce,
            args=(iter(self._source), self._transform),
            name="keras_dist-prefetch",
            daemon=True,
        )
        self._thread.start()

    def _put(self, item) -> bool:
        while not self._stop.is_set():
            try:
                self._queue.put(item, timeout=_POLL_SECONDS)
                return True
            except queue.Full:
                continue
        return False

    def _produce(self, source, transform):
        try:
            for item in source:
                if transform is not None:
                    item = transform(item)
                if not self._put((item, None)):
                    return
            self._put((_END, None))
        except BaseException as error:  # handed to the consumer, in order
            self._put((_END, error))

    def __iter__(self):
        return self

    def __next__(self):
        if self._done:
            raise StopIteration
        if self._thread is None:
            self._start()
        item, error = self._queue.get()
        if item is _END:
            self._done = True
            if error is not None:
                raise error
            raise StopIteration
        return item

    def close(self) -> None:
        """Stops reading ahead; the thread ends at its next item or poll."""
        self._stop.set()

    def __del__(self):
        self.close()
