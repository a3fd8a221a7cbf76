"""``RemoteValue``: the result of a scheduled function, filled in when it has run."""

import copy
import threading

import jax

from keras_dist import errors


def raisable(error: BaseException) -> BaseException:
    """A copy of a kept ``error`` to raise, with its cause.

    Raising an exception adds the frames it passes through to its traceback:
    raised itself, a kept error would keep the caller's frames (and a model
    in them) alive as long as the coordinator keeps the error.
    """
    fresh = copy.copy(error).with_traceback(None)
    fresh.__cause__ = error.__cause__
    return fresh


class RemoteValue:
    """The future result of ``ClusterCoordinator.schedule``.

    ``fetch()`` waits for the function and returns its result as NumPy values;
    ``get()`` waits and returns it too. A function that failed raises its error
    from both.

    >>> import keras, numpy as np, keras_dist as kd
    >>> strategy = kd.ParameterServerStrategy(
    ...     kd.testing.create_in_process_cluster(num_workers=1, num_ps=1))
    >>> with strategy.scope():
    ...     total = keras.Variable(0.0)
    >>> coordinator = kd.coordinator.ClusterCoordinator(strategy)
    >>> def step(x):
    ...     total.assign_add(x)
    ...     return total.value * 2.0
    >>> remote = coordinator.schedule(step, args=(np.float32(3.0),))
    >>> float(remote.fetch())
    6.0
    """

    def __init__(self):
        self._done = threading.Event()
        self._value = None
        self._error = None

    def _set(self, value=None, error=None) -> None:
        self._value, self._error = value, error
        self._done.set()

    def set_value(self, value) -> None:
        """Fills in the result (the coordinator's worker threads call this)."""
        self._set(value=value)

    def set_error(self, error: BaseException) -> None:
        """Fills in the error that ``fetch`` and ``get`` raise."""
        self._set(error=error)

    def reset(self) -> None:
        """Makes the value pending again (its function was put back in the queue)."""
        self._done.clear()

    @property
    def done(self) -> bool:
        return self._done.is_set()

    def _wait(self, timeout):
        if not self._done.wait(timeout):
            raise errors.DeadlineExceededError(
                f"The scheduled function did not finish within {timeout} s. "
                "Call `coordinator.join()` to wait for every function, or raise the timeout. "
                f"Received: timeout={timeout}"
            )
        if self._error is not None:
            raise raisable(self._error)

    def fetch(self, timeout: "float | None" = None):
        """Waits for the result and returns it with NumPy arrays (``timeout`` in seconds)."""
        self._wait(timeout)
        return jax.tree_util.tree_map(lambda x: x, self._value)

    def get(self, timeout: "float | None" = None):
        """Waits for the result and returns it."""
        self._wait(timeout)
        return self._value

    def __repr__(self):
        state = "done" if self.done else "pending"
        return f"<RemoteValue {state}>"
