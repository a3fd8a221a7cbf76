"""Keeps multi-device executions on the CPU backend from overlapping anything.

jaxlib 0.10.2 on CPU with several simulated devices aborts ("Expected 4 threads
to join the rendezvous, but only 3 of them arrived on time") when executions
holding collectives overlap, and hangs across processes
(``docs/architecture.md``, "A jaxlib hazard"). It also aborts when other
executions that wait on a collective program's results are dispatched while it
runs: each device admits a bounded number of programs in flight, and a device's
share of the collective program, launched late, can find its device full of
programs waiting on it. So every multi-device execution of keras_dist goes
through ``call``, which waits for the previous one before dispatching and for
this one before returning. Only ``deferring`` lets a compiled step's program run
on when ``call`` returns: for a training loop that dispatches nothing in between
(the next ``call`` or ``wait`` waits for it). On accelerators
``call`` only dispatches.
"""

import contextlib
import threading

import jax


class ExecutionGate:
    """Serializes multi-device executions when ``serialize`` is true.

    >>> import jax.numpy as jnp
    >>> gate = ExecutionGate()
    >>> gate.call(True, jnp.add, 1, 2).is_ready()
    True
    """

    def __init__(self):
        self._lock = threading.Lock()
        self._in_flight = None
        self._deferring = threading.local()

    def call(self, serialize: bool, fn, *args, may_run_on: bool = False, dispatch=None):
        """``fn(*args)``: serialized with every other call when ``serialize``.

        With ``may_run_on`` (a compiled step's program) the execution may still
        run when this returns, within ``deferring`` only. ``dispatch(fn, *args,
        run_on=...)``, where given, dispatches instead and returns the outputs and
        what to wait on (``PeerWatch.dispatch``: across processes, with a deadline).
        """
        if not serialize:
            return fn(*args)
        with self._lock:
            self._wait()
            run_on = may_run_on and getattr(self._deferring, "on", False)
            if dispatch is None:
                out = fn(*args)
                self._in_flight = _first_array(out)
            else:
                out, self._in_flight = dispatch(fn, *args, run_on=run_on)
            if not run_on:
                self._wait()
            return out

    def wait(self):
        """Waits for an execution left running by ``deferring``."""
        if self._in_flight is None:  # (read without the lock: only a deferred call sets it)
            return
        with self._lock:
            self._wait()

    @contextlib.contextmanager
    def deferring(self):
        """Within, a step's program this thread dispatches may still run after ``call``.

        For a caller that dispatches nothing else before its next step (Keras's
        loop between two compiled steps): its host work then overlaps the running
        step. Whatever runs next and may read the step's results must call
        ``wait`` first. Other executions (reductions, eager replicas) still end
        before their ``call`` returns.
        """
        previous = getattr(self._deferring, "on", False)
        self._deferring.on = True
        try:
            yield
        finally:
            self._deferring.on = previous

    def _wait(self):
        pending, self._in_flight = self._in_flight, None
        if pending is None or (isinstance(pending, jax.Array) and pending.is_deleted()):
            return
        pending.block_until_ready()


def _first_array(tree):
    """One output: a program's outputs on its devices are ready when its devices' share ends."""
    for leaf in jax.tree_util.tree_leaves(tree):
        if isinstance(leaf, jax.Array) and not isinstance(leaf, jax.core.Tracer):
            return leaf
    return None  # also when called while tracing: nothing runs yet


GATE = ExecutionGate()


def needs_serializing(devices) -> bool:
    """Whether executions over ``devices`` must not overlap (several CPU devices)."""
    return len(devices) > 1 and devices[0].platform == "cpu"
