"""Real cluster managers for tests: a one-node Slurm cluster of its own, and OpenMPI's mpirun.

``SlurmCluster`` starts its own ``slurmctld`` and ``slurmd`` (free ports, a temp directory,
``SLURM_CONF`` pointing there), so it neither needs nor touches another Slurm on the machine,
and stops them at the end. ``*_skip_reason`` say why a manager cannot be used here; the tests
skip with that reason.

Every address the tests use is this machine's short hostname (Slurm's node name) or
127.0.0.1, and the hostname must resolve to a loopback address.
"""

import os
import re
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path

from keras_dist.testing import pick_unused_port

_SLURM_BINARIES = ("slurmctld", "slurmd", "srun", "sinfo", "scontrol", "scancel", "squeue")
_MUNGE_SOCKET_DIR = Path("/run/munge")
_START_TIMEOUT = 40  # seconds for munged / the node to come up


def hostname() -> str:
    """The short hostname: Slurm's node name (``hostname -s``)."""
    return socket.gethostname().split(".")[0]


def loopback_skip_reason(host: str) -> "str | None":
    """Why ``host`` cannot be used (it does not resolve to loopback only), or None."""
    try:
        addresses = {info[4][0] for info in socket.getaddrinfo(host, None)}
    except OSError as error:
        return f"the hostname {host!r} does not resolve ({error})"
    if not all(a.startswith("127.") or a == "::1" for a in addresses):
        return (
            f"the hostname {host!r} resolves to {sorted(addresses)}, not only loopback: "
            "these tests may only use loopback addresses"
        )
    return None


# Where a cluster comes from (keras_dist's resolvers, srun, mpirun): this process's own, if it
# runs in a cluster, must not reach the tasks, which would join that cluster instead.
_CLUSTER_VARIABLES = ("TF_CONFIG", "COORDINATOR_ADDRESS", "COORDINATOR_PORT", "NUM_PROCESSES")
_CLUSTER_VARIABLES += ("PROCESS_ID", "KERAS_DIST_SLURM_PORT_BASE", "KERAS_DIST_COORDINATOR_PORT")
_CLUSTER_PREFIXES = ("KERAS_DISTRIBUTION_", "JAX_COORDINATOR_", "JAX_NUM_PROCESSES")
_CLUSTER_PREFIXES += ("JAX_PROCESS_ID", "SLURM_", "OMPI_", "PMIX_")


def clean_environ() -> dict:
    """``os.environ`` without the variables that place a process in a cluster."""
    return {
        name: value
        for name, value in os.environ.items()
        if name not in _CLUSTER_VARIABLES and not name.startswith(_CLUSTER_PREFIXES)
    }


def free_port_range(count: int) -> int:
    """The first of ``count`` consecutive ports free on 127.0.0.1 (Slurm tasks get base + i)."""
    for _ in range(100):
        base = pick_unused_port()
        if base + count <= 65536 and all(_free(base + i) for i in range(1, count)):
            return base
    raise RuntimeError(f"No {count} consecutive free ports found on 127.0.0.1.")


def _free(port: int) -> bool:
    with socket.socket() as probe:
        try:
            probe.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def _search_path() -> str:
    """``PATH`` with the system directories where the daemons live (not every ``PATH`` has)."""
    return os.pathsep.join([os.environ.get("PATH", os.defpath), "/usr/sbin", "/sbin"])


def _missing(binaries) -> list:
    return [name for name in binaries if shutil.which(name, path=_search_path()) is None]


def slurm_skip_reason() -> "str | None":
    """Why a Slurm cluster cannot be started here, or None."""
    if os.geteuid() != 0:
        return "starting slurmctld, slurmd and munged needs root"
    missing = _missing(_SLURM_BINARIES + ("munged", "munge", "unmunge"))
    if missing:
        return f"Slurm is not installed (apt-get install slurm-wlm munge): missing {missing}"
    return loopback_skip_reason(hostname())


def mpirun_skip_reason() -> "str | None":
    """Why OpenMPI's mpirun cannot be used here, or None."""
    if _missing(("mpirun",)):
        return "OpenMPI is not installed (apt-get install openmpi-bin): no mpirun"
    done = subprocess.run(["mpirun", "--version"], capture_output=True, text=True, timeout=30)
    version = re.search(r"\(Open MPI\) (\d+)\.", done.stdout)
    if version is None:
        return f"mpirun is not OpenMPI's: {done.stdout.strip()[:200]!r}"
    if version.group(1) != "4":
        # Its ranks have no OMPI_MCA_orte_hnp_uri (OpenMPI 5 runs PRRTE instead of ORTE).
        return f"OpenMPIClusterResolver reads OpenMPI 4's mpirun; this is {done.stdout.strip()!r}"
    return None


def _munge_works() -> bool:
    """Whether munged answers: a credential made by ``munge`` is accepted by ``unmunge``."""
    try:
        made = subprocess.run(["munge", "-n"], capture_output=True, timeout=10)
        if made.returncode != 0:
            return False
        read = subprocess.run(["unmunge"], input=made.stdout, capture_output=True, timeout=10)
    except subprocess.TimeoutExpired:
        return False
    return read.returncode == 0


def ensure_munged() -> None:
    """Starts munged unless one already answers; raises RuntimeError saying why it could not.

    A munged started here is left running at the end: it is the machine's authentication
    daemon, and another Slurm on this machine may have come to rely on it meanwhile.
    """
    if _munge_works():
        return
    _MUNGE_SOCKET_DIR.mkdir(parents=True, exist_ok=True)
    shutil.chown(_MUNGE_SOCKET_DIR, "munge", "munge")
    munged = shutil.which("munged", path=_search_path())
    started = subprocess.run(
        ["su", "-s", "/bin/sh", "munge", "-c", munged],
        capture_output=True,
        text=True,
        timeout=30,
    )
    deadline = time.monotonic() + _START_TIMEOUT
    while not _munge_works():
        if time.monotonic() > deadline:
            raise RuntimeError(
                f"munged did not start (exit {started.returncode}): "
                f"{(started.stdout + started.stderr).strip()}"
            )
        time.sleep(0.2)


_CONF = """\
ClusterName=kdtest
SlurmctldHost={host}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
SlurmctldPort={ctld_port}
SlurmdPort={slurmd_port}
# slurmd and srun bind the address the node name resolves to (loopback), not every address.
CommunicationParameters=NoInAddrAny
StateSaveLocation={dir}/state
SlurmdSpoolDir={dir}/spool
SlurmctldPidFile={dir}/slurmctld.pid
SlurmdPidFile={dir}/slurmd.pid
SlurmctldLogFile={dir}/slurmctld.log
SlurmdLogFile={dir}/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
# The node as configured even where slurmd counts the hardware otherwise (containers).
SlurmdParameters=config_overrides
ReturnToService=2
MpiDefault=none
NodeName={host} CPUs={cpus} State=UNKNOWN
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE
"""


class SlurmCluster:
    """A one-node Slurm cluster of its own: ``start()``, ``srun(...)``, ``logs()``, ``stop()``."""

    def __init__(self):
        self.host = hostname()
        # Short: slurmd's unix sockets live under it (108 characters at most).
        self.directory = Path(tempfile.mkdtemp(prefix="kd-slurm-"))
        self.conf = self.directory / "slurm.conf"
        self.env = {**clean_environ(), "SLURM_CONF": str(self.conf), "PATH": _search_path()}

    def start(self) -> None:
        """Writes the configuration, starts both daemons and waits for the node to be idle."""
        for name in ("state", "spool"):
            (self.directory / name).mkdir()
        self.conf.write_text(
            _CONF.format(
                host=self.host,
                ctld_port=pick_unused_port(),
                slurmd_port=pick_unused_port(),
                dir=self.directory,
                cpus=len(os.sched_getaffinity(0)),  # nproc's count
            )
        )
        # -i: ignore state left by an earlier run; none exists in a fresh directory anyway.
        self._run(["slurmctld", "-i", "-f", str(self.conf)])
        self._run(["slurmd", "-f", str(self.conf)])
        self._wait_until_idle()

    def _run(self, command, timeout=30) -> subprocess.CompletedProcess:
        done = subprocess.run(
            command, env=self.env, capture_output=True, text=True, timeout=timeout
        )
        if done.returncode != 0:
            raise RuntimeError(
                f"{' '.join(command)} exited {done.returncode}: {done.stdout}{done.stderr}\n"
                f"{self.logs()}"
            )
        return done

    def _wait_until_idle(self) -> None:
        deadline = time.monotonic() + _START_TIMEOUT
        state = ""
        while time.monotonic() < deadline:
            done = subprocess.run(
                ["sinfo", "-h", "-n", self.host, "-o", "%T"],
                env=self.env,
                capture_output=True,
                text=True,
                timeout=10,
            )
            state = (done.stdout + done.stderr).strip()
            if done.returncode == 0 and state.startswith("idle"):
                return
            time.sleep(0.3)
        raise RuntimeError(f"The Slurm node did not become idle: sinfo says {state!r}.")

    def srun(self, args, *, log_dir, env=None, timeout=180) -> subprocess.CompletedProcess:
        """Runs ``srun ARGS`` (each task's output in ``log_dir/task-N.log``); cancels on timeout.

        ``--kill-on-bad-exit`` ends the step when a task fails, so its peers do not wait for
        it until the timeout. The step's own time limit (a few minutes) ends tasks that this
        process could not stop.
        """
        name = f"kd-{os.getpid()}-{time.monotonic_ns()}"
        command = ["srun", f"--job-name={name}", "--kill-on-bad-exit=1", "--time=5"]
        command += [f"--output={log_dir}/task-%t.log", *args]

        def cancel(_process):
            subprocess.run(["scancel", f"--name={name}"], env=self.env, timeout=30)

        return run_with_timeout(command, {**self.env, **(env or {})}, timeout, cancel)

    def logs(self) -> str:
        """slurmctld's and slurmd's logs, for a failing test's message."""
        parts = []
        for name in ("slurmctld.log", "slurmd.log"):
            path = self.directory / name
            text = path.read_text(errors="replace") if path.exists() else "(none)"
            parts.append(f"--- {name} ---\n{text[-6000:]}")
        return "\n".join(parts)

    def stop(self) -> None:
        """Cancels what still runs, stops both daemons and removes the directory."""
        if self.conf.exists():
            for command in (["scancel", "--user=root"], ["scontrol", "shutdown"]):
                try:
                    subprocess.run(command, env=self.env, capture_output=True, timeout=30)
                except subprocess.TimeoutExpired:
                    pass  # the daemons are killed below
        for name in ("slurmd.pid", "slurmctld.pid"):
            _stop_pid_file(self.directory / name)
        shutil.rmtree(self.directory, ignore_errors=True)


def mpirun(args, *, log_dir, env=None, timeout=180) -> subprocess.CompletedProcess:
    """Runs OpenMPI's ``mpirun ARGS`` on this machine, its ranks' logs in ``log_dir``.

    ``oob_tcp_if_include`` keeps mpirun's daemon on loopback: its URI
    (``OMPI_MCA_orte_hnp_uri``, where the coordinator's host comes from) then lists
    127.0.0.1 only. ``--timeout`` makes mpirun end the job itself.
    """
    command = ["mpirun", "--oversubscribe", "--bind-to", "none"]
    command += ["--mca", "oob_tcp_if_include", "127.0.0.0/8", "--timeout", str(timeout)]
    command += ["--output-filename", str(log_dir), *args]
    # As root mpirun refuses to start without both (we are root in CI).
    allow_root = {"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"}

    def kill(process):
        os.killpg(process.pid, signal.SIGKILL)

    return run_with_timeout(
        command, {**clean_environ(), **allow_root, **(env or {})}, timeout + 30, kill
    )


def run_with_timeout(command, env, timeout, stop) -> subprocess.CompletedProcess:
    """Runs ``command``; past ``timeout`` seconds calls ``stop(process)`` and returns code 124."""
    process = subprocess.Popen(
        command,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,  # its own process group, for ``stop`` to end all of it
    )
    try:
        output, _ = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        stop(process)
        try:
            output, _ = process.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            output, _ = process.communicate()
        output += f"\n[{command[0]} did not finish within {timeout} s: it was stopped]"
        return subprocess.CompletedProcess(command, 124, output)
    return subprocess.CompletedProcess(command, process.returncode, output)


def _stop_pid_file(path: Path, grace: float = 10.0) -> None:
    """Waits for the daemon of ``path`` to leave (after ``scontrol shutdown``); else kills it."""
    try:
        pid = int(path.read_text().strip())
    except (OSError, ValueError):
        return
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.1)
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def task_logs(log_dir: Path) -> str:
    """Every task's log in ``log_dir``, for a failing test's message.

    srun's ``--output=DIR/task-%t.log`` (stdout and stderr together) or mpirun's
    ``--output-filename DIR`` (``DIR/<job>/rank.N/stdout`` and ``stderr``).
    """
    paths = sorted(Path(log_dir).glob("task-*.log")) + sorted(Path(log_dir).glob("*/rank.*/std*"))
    if not paths:
        return f"(no task wrote a log in {log_dir})"
    return "\n".join(
        f"--- {p.relative_to(log_dir)} ---\n{p.read_text(errors='replace')}" for p in paths
    )
