"""`Prefetch`: read an input pipeline ahead, on a background thread.

While a step runs, the next batches are read (and, for distributed datasets,
split and transferred to the devices: ``jax.device_put`` is asynchronous), so
an input pipeline that waits on storage costs little when its waits are no
longer than the steps. The buffer is bounded; errors reach the consumer in
order.

The thread never holds the ``Prefetch`` object itself, only its queue and stop
flag: when the consumer drops the iterator (a ``break``, ``steps_per_epoch``,
an exception), it is garbage-collected, its finalizer sets the flag, and the
thread ends within one poll, releasing the batches it held. ``close()`` does
the same at once.

At interpreter exit every thread still reading is stopped and waited for
(``_stop_every_reader``, an ``atexit`` hook registered when the first thread
starts, so after TensorFlow's own): a daemon thread left inside a
``tf.data`` iterator's C++ code while Python finalizes is torn down there,
and the process aborts ("terminate called after throwing an instance of ...",
return code 134) where the script had ended cleanly.
"""

import atexit
import queue
import threading
import time
import weakref

_END = object()
_POLL_SECONDS = 0.1  # how often a blocked producer checks whether it should stop
# How long exit waits for readers in all: a reader inside one slow element (a file
# read) finishes it first; one that never returns is left to the interpreter.
_EXIT_GRACE_SECONDS = 10.0


class Prefetch:
    """Iterates ``iterable`` (through ``transform``) ``buffer_size`` items ahead.

    >>> list(Prefetch(range(5), buffer_size=2))
    [0, 1, 2, 3, 4]
    """

    def __init__(self, iterable, buffer_size: int = 2, transform=None):
        if not isinstance(buffer_size, int) or buffer_size < 1:
            raise ValueError(
                "`buffer_size` must be an integer, at least 1. "
                f"Received: buffer_size={buffer_size!r}"
            )
        self._stop = threading.Event()
        self._queue: queue.Queue = queue.Queue(maxsize=buffer_size)
        self._done = False
        self._source, self._transform = iterable, transform
        self._thread = None  # started by the first `next`: nothing is read before it
        # Stops the thread when this object is collected, without the thread holding it.
        self._finalizer = weakref.finalize(self, _drain, self._stop, self._queue)

    def _start(self):
        self._thread = threading.Thread(
            target=_produce,
            args=(iter(self._source), self._transform, self._queue, self._stop),
            name="keras_dist-prefetch",
            daemon=True,
        )
        self._source = None  # the thread owns the iterator now
        _READERS.started(self._thread, self._stop, self._queue)

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
            self._finalizer()
            if error is not None:
                raise error
            raise StopIteration
        return item

    def close(self) -> None:
        """Stops reading ahead and drops the batches read; the thread ends within a poll."""
        self._done = True
        self._finalizer()

    @property
    def running(self) -> bool:
        """Whether the read-ahead thread is alive."""
        return self._thread is not None and self._thread.is_alive()


class _Readers:
    """The read-ahead threads still running, stopped and waited for at exit."""

    def __init__(self):
        self._lock = threading.Lock()
        self._running: dict = {}  # thread -> (stop flag, queue)
        self._registered = False

    def started(self, thread, stop, items) -> None:
        with self._lock:
            if not self._registered:
                atexit.register(self.stop_all)  # (after the hooks of what was imported)
                self._registered = True
            self._running = {t: v for t, v in self._running.items() if t.is_alive()}
            self._running[thread] = (stop, items)
        thread.start()

    def stop_all(self, grace: float = _EXIT_GRACE_SECONDS) -> None:
        """Stops every reader and waits up to ``grace`` seconds for them to end."""
        with self._lock:
            running, self._running = self._running, {}
        for stop, items in running.values():
            _drain(stop, items)
        deadline = time.monotonic() + grace
        for thread, (stop, items) in running.items():
            while thread.is_alive() and time.monotonic() < deadline:
                _drain(stop, items)  # (a producer may have put one more item)
                thread.join(_POLL_SECONDS)


_READERS = _Readers()


def stop_reading_ahead(grace: float = _EXIT_GRACE_SECONDS) -> None:
    """Stops every read-ahead thread and waits for them (what exit does).

    >>> reader = Prefetch(iter(range(100)))
    >>> next(reader)
    0
    >>> stop_reading_ahead()
    >>> reader.running
    False
    """
    _READERS.stop_all(grace)


def _drain(stop: threading.Event, items: queue.Queue) -> None:
    stop.set()
    try:
        while True:
            items.get_nowait()
    except queue.Empty:
        pass


def _put(items: queue.Queue, stop: threading.Event, item) -> bool:
    while not stop.is_set():
        try:
            items.put(item, timeout=_POLL_SECONDS)
            return True
        except queue.Full:
            continue
    return False


def _produce(source, transform, items: queue.Queue, stop: threading.Event) -> None:
    try:
        for item in source:
            if transform is not None:
                item = transform(item)
            if not _put(items, stop, (item, None)):
                return
        _put(items, stop, (_END, None))
    except BaseException as error:  # handed to the consumer, in order
        _put(items, stop, (_END, error))
    finally:
        close = getattr(source, "close", None)
        if close is not None and stop.is_set():
            close()  # a generator stopped early runs its `finally` blocks now
