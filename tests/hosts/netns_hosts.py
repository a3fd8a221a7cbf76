"""Hosts of their own for tests: network namespaces on a private switch, links that fail.

``NetnsHosts(3)`` makes three "hosts", each a network namespace with its own address
(``10.231.0.1``, ``.2``, ``.3``) on a link to a switch (a bridge in a namespace of its
own), its own hostname (a UTS namespace) that resolves to that address (its own
``/etc/hosts``, through ``/etc/netns``), and ``lo`` up. Nothing of the machine's own
network is touched: every namespace, link and address is one the helper made, and the
hosts reach nothing but each other.

``start(i, argv)`` runs a command on host ``i`` (``python(i, ...)`` runs this
interpreter with one simulated CPU device); ``cut(i)`` takes host ``i``'s link down at
the switch (its packets are dropped silently, as with a pulled cable: no reset reaches
anyone), ``restore(i)`` brings it back. Leaving the ``with`` block kills every process
the hosts started and removes the namespaces, also when the test failed; namespaces a
killed test run left behind are removed by the next run. Names carry this process's id,
so parallel pytest workers never collide.

Needs root, ``ip`` (iproute2) and ``unshare`` (util-linux); ``skip_reason()`` says why
not where the machine refuses (tests skip with it).
"""

import contextlib
import os
import pathlib
import shutil
import signal
import subprocess
import sys
import tempfile
import time

PREFIX = "kdhosts"
SUBNET = "10.231.0"  # a /24 that exists only on the helper's own switch
_ETC_NETNS = pathlib.Path("/etc/netns")
_COUNTER = iter(range(1_000_000))
# What a task on a host starts from: this machine's proxies lead nowhere there (gRPC
# honours them), and the test process's 8 simulated devices are not the task's.
_DROPPED_ENV = ("http_proxy", "https_proxy", "all_proxy", "grpc_proxy", "XLA_FLAGS")
_DROPPED_ENV += tuple(name.upper() for name in _DROPPED_ENV[:4])


def _ip(*args, check=True):
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check, timeout=30)


def skip_reason():
    """Why namespaces cannot be made here, or ``None`` when they can."""
    if os.geteuid() != 0:
        return "network namespaces need root (CI runs the tests as root)"
    for tool in ("ip", "unshare"):
        if shutil.which(tool) is None:
            return f"`{tool}` is not installed (iproute2 / util-linux)"
    probe = f"{PREFIX}-{os.getpid()}-probe"
    made = _ip("netns", "add", probe, check=False)
    if made.returncode != 0:
        return f"the kernel refused a network namespace: {made.stderr.strip()}"
    _ip("netns", "del", probe, check=False)
    return None


def remove_stale_namespaces():
    """Removes the namespaces of helpers whose process is gone (a killed test run)."""
    listed = _ip("netns", "list", check=False).stdout.split()
    for name in listed:
        parts = name.split("-")
        if parts[0] != PREFIX or len(parts) < 3 or not parts[1].isdigit():
            continue
        if not pathlib.Path(f"/proc/{parts[1]}").exists():
            _ip("netns", "del", name, check=False)
            shutil.rmtree(_ETC_NETNS / name, ignore_errors=True)


class NetnsHosts:
    """``count`` hosts (2 to 5) on a private switch; use it as a context manager.

    Attributes:
        addresses: host ``i``'s IPv4 address.
        hostnames: host ``i``'s hostname (``host0``...), resolving to its address there.
    """

    def __init__(self, count, *, log_dir=None):
        if not 2 <= count <= 5:
            raise ValueError(f"`count` must be 2 to 5 hosts. Received: count={count}")
        self._tag = f"{PREFIX}-{os.getpid()}-{next(_COUNTER)}"
        self._switch = f"{self._tag}-switch"
        self._namespaces = [f"{self._tag}-host{i}" for i in range(count)]
        self.addresses = [f"{SUBNET}.{i + 1}" for i in range(count)]
        self.hostnames = [f"host{i}" for i in range(count)]
        self._log_dir = pathlib.Path(log_dir or tempfile.mkdtemp(prefix=f"{self._tag}-logs-"))
        self._processes = []  # (name, Popen, log path)
        self._made = []  # namespaces made so far, removed on close

    # ---------------------------------------------------------------- setup and teardown
    def __enter__(self):
        remove_stale_namespaces()
        try:
            self._make()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc_info):
        self.close()

    def _namespace(self, name):
        _ip("netns", "add", name)
        self._made.append(name)
        _ip("-n", name, "link", "set", "lo", "up")

    def _make(self):
        self._namespace(self._switch)
        _ip("-n", self._switch, "link", "add", "br0", "type", "bridge")
        _ip("-n", self._switch, "link", "set", "br0", "up")
        _ETC_NETNS.mkdir(exist_ok=True)
        hosts_file = "127.0.0.1 localhost\n" + "".join(
            f"{address} {name}\n" for address, name in zip(self.addresses, self.hostnames)
        )
        for i, name in enumerate(self._namespaces):
            self._namespace(name)
            # The pair is made in place: its ends never exist in this namespace.
            _ip("link", "add", "eth0", "netns", name, "type", "veth", "peer", "name",
                self._port(i), "netns", self._switch)  # fmt: skip
            _ip("-n", self._switch, "link", "set", self._port(i), "master", "br0")
            _ip("-n", self._switch, "link", "set", self._port(i), "up")
            _ip("-n", name, "addr", "add", f"{self.addresses[i]}/24", "dev", "eth0")
            _ip("-n", name, "link", "set", "eth0", "up")
            (_ETC_NETNS / name).mkdir(exist_ok=True)
            (_ETC_NETNS / name / "hosts").write_text(hosts_file)

    @staticmethod
    def _port(i):
        return f"port{i}"

    def close(self):
        """Kills every process the hosts started, then removes the namespaces."""
        for _, process, _ in self._processes:
            if process.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(process.pid, signal.SIGKILL)
        for _, process, _ in self._processes:
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.wait(timeout=10)
        for name in reversed(self._made):
            _ip("netns", "del", name, check=False)
            shutil.rmtree(_ETC_NETNS / name, ignore_errors=True)
        self._made.clear()

    # ------------------------------------------------------------------------- processes
    def start(self, host, argv, *, env=None, name=None):
        """Starts ``argv`` on ``host`` with ``env`` (the whole environment); its ``Popen``."""
        name = name or f"host{host}: {pathlib.Path(str(argv[-1])).name}"
        log_path = self._log_dir / f"{len(self._processes)}-host{host}.log"
        command = ["ip", "netns", "exec", self._namespaces[host], "unshare", "--uts", "sh", "-c"]
        command += ['hostname "$0" && exec "$@"', self.hostnames[host], *argv]
        with open(log_path, "wb") as log:
            process = subprocess.Popen(
                command, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
            )
        self._processes.append((name, process, log_path))
        return process

    def python(self, host, script, *args, env=None, name=None):
        """Runs ``script`` with this interpreter on ``host``: one CPU device, JAX's Keras.

        ``env`` is added to this process's environment (without its proxies and XLA flags).
        """
        environment = {k: v for k, v in os.environ.items() if k not in _DROPPED_ENV}
        environment.update(
            PYTHONUNBUFFERED="1",
            KERAS_BACKEND="jax",
            JAX_PLATFORMS="cpu",
            XLA_FLAGS="--xla_force_host_platform_device_count=1",
        )
        environment.update(env or {})
        argv = [sys.executable, str(script), *map(str, args)]
        return self.start(host, argv, env=environment, name=name)

    def host_command(self, directory):
        """A launcher's ``host_command`` that runs a task on the host of its address.

        As ``ssh {host}`` would on a cluster: a script (written to ``directory``) enters
        the host's namespaces, without this machine's proxies.
        """
        script = pathlib.Path(directory) / "on_host"
        cases = "".join(
            f"  {address}) ns={namespace}; name={hostname};;\n"
            for address, namespace, hostname in zip(
                self.addresses, self._namespaces, self.hostnames
            )
        )
        unset = " ".join(f"-u {name}" for name in _DROPPED_ENV if name != "XLA_FLAGS")
        script.write_text(
            '#!/bin/sh\ncase "$1" in\n'
            f'{cases}  *) echo "on_host: no host $1" >&2; exit 2;;\nesac\nshift\n'
            f'exec env {unset} ip netns exec "$ns" unshare --uts '
            """sh -c 'hostname "$0" && exec "$@"' "$name" "$@"\n"""
        )
        script.chmod(0o755)
        return f"{script} {{host}}"

    def logs(self):
        """Every process's output so far, each under its name and exit status."""
        parts = []
        for name, process, log_path in self._processes:
            text = log_path.read_text(errors="replace") if log_path.exists() else ""
            parts.append(f"===== {name} (exit status {process.poll()}) =====\n{text}")
        return "\n".join(parts)

    # ---------------------------------------------------------------------------- links
    def cut(self, host):
        """Takes ``host``'s link down at the switch: its packets are dropped from now on."""
        _ip("-n", self._switch, "link", "set", self._port(host), "down")

    def restore(self, host):
        """Brings ``host``'s link back up."""
        _ip("-n", self._switch, "link", "set", self._port(host), "up")

    def can_reach(self, source, target, port, timeout=2.0):
        """Whether a TCP connection from ``source`` to ``target:port`` is answered in time.

        A refused connection counts as reached (the host answered).
        """
        probe = (
            "import socket, sys\n"
            "try:\n"
            f"    socket.create_connection(({self.addresses[target]!r}, {port}), {timeout})\n"
            "except ConnectionRefusedError:\n"
            "    pass\n"
            "except OSError:\n"
            "    sys.exit(3)\n"
        )
        command = ["ip", "netns", "exec", self._namespaces[source], sys.executable, "-c", probe]
        return subprocess.run(command, capture_output=True, timeout=timeout + 30).returncode == 0

    def namespaces(self):
        """The namespaces made (the switch's first), for checks."""
        return list(self._made)


def wait_for_file(path, timeout, *, processes=(), what="the file"):
    """Waits until ``path`` exists; ``TimeoutError`` past ``timeout`` or once all exited."""
    deadline = time.monotonic() + timeout
    path = pathlib.Path(path)
    while not path.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} ({path}) did not appear within {timeout} s")
        if processes and all(p.poll() is not None for p in processes):
            raise TimeoutError(f"every process exited before {what} ({path}) appeared")
        time.sleep(0.1)


def wait_all(processes, timeout):
    """Each process's exit status; ``TimeoutError`` (processes left running) past ``timeout``."""
    deadline = time.monotonic() + timeout
    for process in processes:
        try:
            process.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            raise TimeoutError(f"a task was still running after {timeout} s") from None
    return [process.returncode for process in processes]
