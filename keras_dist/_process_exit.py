"""How a process of a multi-process JAX job ends: at once after a failure, together otherwise.

JAX's shutdown (an exit hook) waits at a barrier for every process. Two
things keep that from hanging:

* A process that fails leaves at once (``leave_now``), without that barrier:
  its peers may be waiting for it in a collective, and only its connections
  closing tells them. It first writes that it failed into the coordination
  service's key-value store.
* A process whose program ended waits for its peers before JAX's shutdown
  (``wait_for_peers_at_exit``): until every peer has ended too, then JAX's
  barrier completes at once; or until one has failed, then it leaves without
  the barrier, which that peer will never reach. TF's workers end so too.
  (A peer killed without a word, by SIGKILL, is found by JAX's heartbeats.)
"""

import atexit
import os
import sys
import threading
import time

from jax._src import distributed

_FAILED = "keras_dist/process_failed/"
_ENDED = "keras_dist/process_ended/"
_POLL_SECONDS = 0.2
_TELL_SECONDS = 2.0
# Then JAX's shutdown takes over (its own barrier's default timeout is as long).
_WAIT_SECONDS = 300.0
_hook_installed = False


def leave_now(code: int) -> None:
    """Ends this process at once, without JAX's shutdown; a failure is told to the peers first.

    >>> callable(leave_now)  # ends the process: not run here
    True
    """
    if code != 0:
        _tell_peers(_FAILED)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def install_exit_wait() -> None:
    """Registers ``wait_for_peers_at_exit`` to run before JAX's own exit hook (once)."""
    global _hook_installed
    if not _hook_installed:
        _hook_installed = True
        # atexit runs the last registered first: JAX registered its hook on import.
        atexit.register(wait_for_peers_at_exit)


def wait_for_peers_at_exit() -> None:
    """Returns once every peer's program has ended; leaves at once if one failed instead.

    Leaving keeps status 0: this process's program ended without an error.
    """
    client = distributed.global_state.client
    state = distributed.global_state
    if client is None:
        return
    _tell_peers(_ENDED)
    peers = set(range(state.num_processes)) - {state.process_id}
    deadline = time.monotonic() + _WAIT_SECONDS
    while time.monotonic() < deadline:
        try:
            failed = _processes(client, _FAILED)
            ended = _processes(client, _ENDED)
        except Exception:
            # The coordination service (in process 0) is gone: so is that process.
            leave_now(0)
        if failed & peers:
            leave_now(0)
        if peers <= ended:
            return
        time.sleep(_POLL_SECONDS)


def _tell_peers(prefix: str) -> None:
    """Writes this process's key under ``prefix``; gives up after ``_TELL_SECONDS``.

    On a daemon thread: the service's host may be stuck (SIGSTOP), and a process
    on its way out after a failure must not wait on it. The peers then find out
    by themselves (their collectives' deadline, JAX's heartbeats).
    """
    client = distributed.global_state.client
    if client is None:
        return
    key = f"{prefix}{distributed.global_state.process_id}"

    def tell():
        try:
            client.key_value_set(key, "1")
        except Exception:  # the service is gone too
            pass

    thread = threading.Thread(target=tell, name="keras_dist-tell-peers", daemon=True)
    thread.start()
    thread.join(_TELL_SECONDS)


def _processes(client, prefix: str) -> set:
    return {int(key.rsplit("/", 1)[-1]) for key, _ in client.key_value_dir_get(prefix)}
