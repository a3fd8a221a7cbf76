"""Keeps one multi-device execution in flight on the CPU backend.

jaxlib 0.10.2 on CPU with several simulated devices aborts ("Expected 4 threads
to join the rendezvous, but only 3 of them arrived on time") when executions
holding collectives overlap, and hangs across processes
(``docs/architecture.md``, "A jaxlib hazard"). Every multi-device execution of
keras_dist goes through ``call``: it waits for the previous one to finish before
dispatching the next, while host work (Python, input) still overlaps the running
step. On accelerators it only dispatches.
"""

import threading

import jax


class ExecutionGate:
    """Serializes multi-device executions when ``serialize`` is true."""

    def __init__(self):
        self._lock = threading.Lock()
        self._in_flight = None

    def call(self, serialize: bool, fn, *args):
        if not serialize:
            return fn(*args)
        with self._lock:
            self._wait()
            out = fn(*args)
            self._in_flight = _first_array(out)
            return out

    def wait(self):
        with self._lock:
            self._wait()

    def _wait(self):
        pending, self._in_flight = self._in_flight, None
        if pending is not None and not pending.is_deleted():
            pending.block_until_ready()


def _first_array(tree):
    for leaf in jax.tree_util.tree_leaves(tree):
        if isinstance(leaf, jax.Array) and not isinstance(leaf, jax.core.Tracer):
            return leaf
    return None  # also when called while tracing: nothing runs yet


GATE = ExecutionGate()


def needs_serializing(devices) -> bool:
    """Whether executions over ``devices`` must not overlap (several CPU devices)."""
    return len(devices) > 1 and devices[0].platform == "cpu"
