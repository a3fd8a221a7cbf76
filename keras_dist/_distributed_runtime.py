"""JAX's multi-process runtime, as ``MultiWorkerMirroredStrategy`` uses it.

* ``initialize`` starts ``jax.distributed`` once per process (gloo
  collectives on CPU) and refuses, with a message saying why, when JAX has
  already started on its own.

A process whose program ends waits for its peers' programs to end, and leaves
at once if one failed (``_process_exit``); ``_peer_watch`` waits for each
execution across processes.

Two more things happen around ``jax.distributed.initialize``:

* The process that hosts the coordination service (process 0: the chief, else
  worker 0) first checks that the coordinator's port is free, and raises an
  ``OSError`` naming the address when it is not (JAX would crash in gRPC).
* SIGTERM is taken back from JAX. Its preemption sync manager installs a C
  handler that only records the signal (such processes outlived a SIGTERM for
  minutes; ``docs/architecture.md``, "A jaxlib hazard"). SIGTERM gets back the
  disposition it had, so it ends the process;
  ``hand_sigterm_to_preemption_notifier`` gives it to JAX's notifier while a
  preemption save is asked for (``callbacks/_preemption.py``).
"""

import ctypes
import errno
import os
import signal
import socket
import sys
import threading

import jax

# JAX's own multi-process state: whether it started, and its coordination client.
from jax._src import distributed
from jax._src import xla_bridge

from keras_dist._coordination_host import service_in_own_process
from keras_dist._presence import Presence
from keras_dist._presence import local_address
from keras_dist._process_exit import install_exit_wait
from keras_dist._process_exit import leave_now
from keras_dist._roll_call import roll_call
from keras_dist._roll_call import split_host_port


def is_initialized() -> bool:
    """Whether ``jax.distributed`` has been started in this process."""
    return distributed.global_state.client is not None


def initialize(
    coordinator_address,
    num_processes,
    process_id,
    *,
    timeout_seconds,
    collectives,
    task_names=None,
    cluster="",
):
    """Starts ``jax.distributed`` for this process, or checks the running one matches.

    ``task_names`` are the tasks' names in process order (``"worker 0"``: process 0
    hosts the coordinator), for the errors. Every process first reports in at the
    coordinator's port with ``cluster`` (``_roll_call``): a missing task, or one
    given another cluster, is an error naming it, not JAX's silent wait and abort.
    """
    coordinator_task = task_names[0] if task_names else None
    state = distributed.global_state
    if state.client is not None:
        if (state.num_processes, state.process_id) != (num_processes, process_id):
            raise RuntimeError(
                "jax.distributed is already initialized for another cluster layout: "
                f"{state.num_processes} processes with this one as process "
                f"{state.process_id}, but the cluster resolver describes {num_processes} "
                f"processes with this one as process {process_id}. Received: "
                f"coordinator_address={coordinator_address!r}"
            )
        return
    if xla_bridge.backends_are_initialized():
        raise RuntimeError(
            "MultiWorkerMirroredStrategy must be created before JAX starts: JAX's "
            "multi-process runtime can only be initialized before the first JAX "
            "computation or device query (jax.devices(), creating a Keras model...). "
            "Create the strategy at the top of the program. Received: this process "
            f"(task {process_id} of {num_processes}) already used JAX."
        )
    _check_coordinator_address(coordinator_address, coordinator_task)
    if process_id == 0:
        # JAX starts the coordination service in process 0.
        check_coordinator_port(coordinator_address, coordinator_task)
    roll_call(coordinator_address, num_processes, process_id, cluster, timeout_seconds, task_names)
    if collectives is not None:
        jax.config.update("jax_cpu_collectives_implementation", collectives)
    if collectives == "gloo":
        keep_cpu_all_reduces_apart()
    sigterm_before = _sigaction(signal.SIGTERM)
    try:
        with service_in_own_process(linger_seconds=timeout_seconds + 15):
            jax.distributed.initialize(
                coordinator_address=coordinator_address,
                num_processes=num_processes,
                process_id=process_id,
                initialization_timeout=int(timeout_seconds),
                # A peer whose heartbeats stop (dead, or frozen by SIGSTOP) makes JAX
                # abort every process after this long. The watch reports it by name
                # once a collective misses ``timeout_seconds``, and the survivors then
                # report in: JAX's abort must not come first.
                heartbeat_timeout_seconds=int(timeout_seconds) + max(30, int(timeout_seconds)),
            )
    finally:
        _take_sigterm_back(sigterm_before)
    _leave_on_uncaught_exception()
    install_exit_wait()
    global _presence
    _presence = Presence(process_id, local_address(coordinator_address))
    _presence.publish(state.client, num_processes, timeout_seconds)


_NO_ALL_REDUCE_COMBINER = "cpu-all-reduce-combiner"


def keep_cpu_all_reduces_apart() -> None:
    """Turns off XLA's CPU all-reduce combiner (before JAX's backends start).

    It merges a step's all-reduces (gradients, loss, counts) into one tuple
    all-reduce, which runs as one gloo all-reduce per operand. When a peer dies
    during one, the process next to it goes on to the next operand while its
    other neighbour still sends the first one's data: gloo's tag-less messages
    then tear ("op.preamble.length <= op.nbytes. 232 vs 4") and abort that
    healthy process from gloo's own thread. Measured, 4 processes, one killed
    mid-loop: 2 of 4 runs aborted a survivor with the tuple, 0 of 6 with the
    all-reduces apart; a step costs the same (gloo ran them one by one anyway).

    >>> import os
    >>> before = os.environ.get("XLA_FLAGS")
    >>> os.environ["XLA_FLAGS"] = "--xla_disable_hlo_passes=foo"
    >>> keep_cpu_all_reduces_apart(); os.environ["XLA_FLAGS"]
    '--xla_disable_hlo_passes=foo,cpu-all-reduce-combiner'
    >>> _ = os.environ.pop("XLA_FLAGS") if before is None else os.environ.update(XLA_FLAGS=before)
    """
    flags = os.environ.get("XLA_FLAGS", "").split()
    for index, flag in enumerate(flags):
        if flag.startswith("--xla_disable_hlo_passes="):
            if _NO_ALL_REDUCE_COMBINER not in flag.split("=", 1)[1].split(","):
                flags[index] = f"{flag},{_NO_ALL_REDUCE_COMBINER}"
            break
    else:
        flags.append(f"--xla_disable_hlo_passes={_NO_ALL_REDUCE_COMBINER}")
    os.environ["XLA_FLAGS"] = " ".join(flags)


def presence() -> "Presence | None":
    """This process's ``Presence`` (the peers asked directly), once ``initialize`` started JAX."""
    return _presence


_presence = None


# --- The coordinator's port --------------------------------------------------------------


def _check_coordinator_address(coordinator_address, coordinator_task=None):
    """Raises ``ValueError`` unless the address is ``host:port`` with a port JAX can bind
    (a port like ``abc`` crashed gRPC, no port failed deep in JAX, as TF refuses them)."""
    parsed = split_host_port(coordinator_address)
    if parsed is not None and 0 < parsed[1] < 65536:
        return
    where = f" (the address of {coordinator_task}, in the cluster spec or TF_CONFIG)"
    raise ValueError(
        f"The coordinator address must be host:port with a port number from 1 to 65535"
        f"{where if coordinator_task else ''}, e.g. '127.0.0.1:12345'. Received: "
        f"{coordinator_address!r}"
    )


def check_coordinator_port(coordinator_address, coordinator_task=None):
    """Raises ``OSError(EADDRINUSE)`` when the coordinator's port is taken on this machine.

    Binds, then closes, the addresses JAX's coordination service will bind: the
    coordinator's own ``host:port`` and JAX's bind address (``[::]:port`` unless
    ``JAX_COORDINATOR_BIND_ADDRESS`` says otherwise). ``SO_REUSEADDR`` is off, so a
    socket of any other process on the port counts; when that fails, one more try with
    ``SO_REUSEADDR`` (as gRPC binds) tells closed connections of an earlier coordinator
    (TIME_WAIT, which gRPC reuses) from a live socket. An address that is not this
    machine's is not checked.

    >>> with socket.socket() as taken:
    ...     taken.bind(("127.0.0.1", 0)); taken.listen()
    ...     address = "127.0.0.1:%d" % taken.getsockname()[1]
    ...     try:
    ...         check_coordinator_port(address, "worker 0")
    ...     except OSError as error:
    ...         print(error.errno == errno.EADDRINUSE, address in str(error))
    True True
    """
    coordinator = split_host_port(coordinator_address)
    if coordinator is None:
        return  # Not host:port; JAX reports it.
    default_bind = f"[::]:{coordinator[1]}"  # JAX's default: every address, the same port
    bind = split_host_port(os.environ.get("JAX_COORDINATOR_BIND_ADDRESS") or default_bind)
    targets = [coordinator] + ([bind] if bind not in (None, coordinator) else [])
    for target in targets:
        if _port_taken(*target):
            raise OSError(
                errno.EADDRINUSE, _port_taken_message(coordinator_address, coordinator_task, target)
            )


def _port_taken_message(coordinator_address, coordinator_task, target):
    where = f" (hosted by {coordinator_task}, this process)" if coordinator_task else ""
    bound = ""
    if target != split_host_port(coordinator_address):
        bound = f" JAX's coordination service binds {_join_host_port(*target)}, and that failed."
    return (
        f"The coordinator address {coordinator_address}{where} is already in use: a socket "
        f"of another program on this machine holds port {target[1]}.{bound} Stop that "
        "process (it may be another task given this task's index), or give this task a "
        "free port (in TF_CONFIG's cluster, or the cluster "
        "resolver's coordinator address); `kd.launch` and `keras-dist launch` pick free "
        "ports themselves."
    )


def _join_host_port(host, port):
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _port_taken(host, port) -> bool:
    """Whether binding ``host:port`` fails because the port is in use (other failures: no)."""
    try:
        infos = socket.getaddrinfo(
            host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )
    except (OSError, UnicodeError):
        return False  # A name this machine cannot resolve: not ours to check.
    for family, kind, protocol, _, sockaddr in infos[:1]:
        for reuse in (False, True):
            try:
                with socket.socket(family, kind, protocol) as probe:
                    if reuse:
                        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                    probe.bind(sockaddr)
                return False
            except OSError as error:
                if error.errno != errno.EADDRINUSE:
                    return False  # Not an address of this machine, no IPv6...: not ours.
        return True
    return False


# --- SIGTERM and JAX's preemption notifier -----------------------------------------------

# JAX's SIGTERM action (a raw ``struct sigaction``), once taken back from it.
_notifier_sigterm = None
_sigterm_lock = threading.Lock()
# While SIGTERM is handed to the notifier: how many asked, and the action to put back.
_handed_over = 0
_sigterm_to_restore = None
# Larger than ``struct sigaction`` on every POSIX system; the handler is its first field.
_SIGACTION_BYTES = 512


def _libc():
    if os.name != "posix":
        return None
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.sigaction.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p]
        return libc
    except (OSError, AttributeError):
        return None


def _sigaction(signum, new=None):
    """The current action of ``signum`` (raw bytes), after setting ``new`` if given.

    Raw ``sigaction`` keeps what Python's ``signal`` module cannot see or restore: a C
    handler (JAX's), and the flags of Python's own handler. None where unsupported.
    """
    libc = _libc()
    if libc is None:
        return None
    old = ctypes.create_string_buffer(_SIGACTION_BYTES)
    if libc.sigaction(int(signum), new, old) != 0:
        return None
    return old


def _handler_of(action):
    return ctypes.c_void_p.from_buffer(action).value if action is not None else None


def _take_sigterm_back(before):
    """Puts back SIGTERM's action from before ``jax.distributed.initialize``."""
    global _notifier_sigterm
    current = _sigaction(signal.SIGTERM)
    if before is None or current is None or _handler_of(current) == _handler_of(before):
        return  # JAX installed nothing (its preemption service is off).
    with _sigterm_lock:
        _sigaction(signal.SIGTERM, before)
        _notifier_sigterm = current


def hand_sigterm_to_preemption_notifier():
    """Gives SIGTERM to JAX's preemption notifier; returns a function that undoes it.

    For a training that saves before a preemption: the notifier records the signal and
    JAX's sync manager tells every process the same step to stop at
    (``multihost_utils.reached_preemption_sync_point``). A no-op returning a no-op when
    keras_dist did not start ``jax.distributed`` (a hand-started JAX keeps SIGTERM all
    along) or JAX installed no notifier (``jax_enable_preemption_service`` off).
    """
    global _handed_over, _sigterm_to_restore
    with _sigterm_lock:
        if _notifier_sigterm is None:
            return lambda: None
        if _handed_over == 0:
            _sigterm_to_restore = _sigaction(signal.SIGTERM, _notifier_sigterm)
        _handed_over += 1
    undone = []

    def undo():
        # Nested hand-overs (two callbacks asking): the last one gives SIGTERM back.
        global _handed_over, _sigterm_to_restore
        with _sigterm_lock:
            if undone:
                return
            undone.append(True)
            _handed_over -= 1
            if _handed_over == 0 and _sigterm_to_restore is not None:
                _sigaction(signal.SIGTERM, _sigterm_to_restore)
                _sigterm_to_restore = None

    return undo


def _leave_on_uncaught_exception():
    original = sys.excepthook

    def excepthook(*exc_info):
        original(*exc_info)
        leave_now(1)

    sys.excepthook = excepthook
