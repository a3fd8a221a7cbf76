"""JAX's coordination service in a process of its own, so that it outlives process 0.

JAX starts its coordination service inside process 0, and every other process
ends itself (``LOG(QFATAL)``: "the JAX distributed service detected fatal
errors") the moment that service cannot be reached. So when process 0 died, or
merely left first after raising its own named error, every healthy survivor
died with it before it could name the lost task. (JAX's hook against this,
``missed_heartbeat_callback``, ends the process too in jaxlib 0.10.2: its status
argument cannot be passed to Python, ``std::bad_cast``.)

``service_in_own_process`` hands JAX a stand-in while ``jax.distributed.initialize``
runs: the service is started in a child Python that loads this file alone (it
imports only jaxlib), in a session of its own, and
* JAX's own shutdown (a program that ended) stops it at once;
* if its parent goes without that (killed, or ``os._exit`` after a failure), it
  stays up ``linger_seconds`` more, for the survivors to name the lost task and
  leave, then ends.
"""

import contextlib
import json
import subprocess
import sys
import tempfile
import time

_READY = "keras_dist coordination service ready"
# The child loads this file alone (not the keras_dist package, which imports Keras).
_CHILD = (
    "import importlib.util, json, sys\n"
    "spec = importlib.util.spec_from_file_location('keras_dist_coordination_host', sys.argv[1])\n"
    "module = importlib.util.module_from_spec(spec)\n"
    "spec.loader.exec_module(module)\n"
    "module.serve(json.loads(sys.argv[2]))\n"
)
_SHUTDOWN = "shutdown"


class ServiceProcess:
    """The stand-in for JAX's ``DistributedRuntimeService``: a child process running it."""

    def __init__(self, address, num_nodes, linger_seconds, **options):
        config = {"address": address, "num_nodes": num_nodes, "options": options}
        config["linger_seconds"] = linger_seconds
        # Its log goes to a file of its own: a child holding this process's stderr
        # would keep a launcher reading this task's output waiting after the task ended.
        log = tempfile.TemporaryFile(mode="w+")
        self._process = subprocess.Popen(
            [sys.executable, "-c", _CHILD, __file__, json.dumps(config)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=log,
            text=True,
            # Out of process 0's process group: a launcher that cleans up after a
            # dead task kills its group, and the survivors still need the service.
            # It ends by itself, ``linger_seconds`` after process 0.
            start_new_session=True,
        )
        line = self._process.stdout.readline().strip()
        if line != _READY:
            self._process.wait(5)
            log.seek(0)
            raise RuntimeError(
                f"JAX's coordination service did not start on {address} (its process "
                f"ended with status {self._process.returncode}): {log.read()[-2000:]}"
            )
        log.close()  # (the child keeps writing to the unlinked file)

    def shutdown(self) -> None:
        """Stops the service now (JAX's shutdown, at the end of a program)."""
        if self._process.poll() is None:
            try:
                self._process.stdin.write(_SHUTDOWN + "\n")
                self._process.stdin.close()
                self._process.wait(30)
            except (OSError, subprocess.TimeoutExpired):
                self._process.kill()


@contextlib.contextmanager
def service_in_own_process(linger_seconds: float):
    """Within, JAX's ``initialize`` starts its coordination service as a ``ServiceProcess``."""
    # Here, not at the top: the child runs this file alone and imports jaxlib itself.
    from jax._src.lib import _jax as jax_runtime

    start_in_process = jax_runtime.get_distributed_runtime_service

    def start(address, num_nodes, **options):
        return ServiceProcess(address, num_nodes, linger_seconds, **options)

    jax_runtime.get_distributed_runtime_service = start
    try:
        yield
    finally:
        jax_runtime.get_distributed_runtime_service = start_in_process


def serve(config) -> None:
    """Runs the service in this (child) process until told to stop, or its parent is gone."""
    # Here, not at the top: only the child process runs the service.
    from jax._src.lib import _jax as jax_runtime

    options = {k: v for k, v in config["options"].items() if v is not None}
    service = jax_runtime.get_distributed_runtime_service(
        config["address"], config["num_nodes"], **options
    )
    print(_READY, flush=True)
    if sys.stdin.readline().strip() != _SHUTDOWN:
        time.sleep(config["linger_seconds"])  # the parent went without a word
    service.shutdown()
