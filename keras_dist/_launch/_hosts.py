"""Tasks on hosts of their own: each task's address, and the command that reaches its host.

By default every task of a launched cluster runs here, on ``127.0.0.1``. With ``hosts``
(one address per task, in task order: chief, workers, then ps), task ``i`` listens on
``hosts[i]`` and its process is started through ``host_command``, a command line whose
``{host}`` is replaced by that address: ``ssh {host}``, or a site's own wrapper. The
hosts must share this machine's file system where the task's script, interpreter and
``keras_dist`` live (a cluster's shared home): the task runs this interpreter there.

The variables the launcher sets for a task (``TF_CONFIG``, device flags, the user's
``env``) and its arguments travel on the command line in one encoded word (a remote
shell neither passes this process's environment nor keeps arguments apart), which the
task's bootstrap unpacks (``_bootstrap.pack``).
"""

import json
import os
import shlex
import subprocess
import sys

from keras_dist._launch._bootstrap import pack
from keras_dist._launch._cluster import task_keys
from keras_dist.cluster_resolver import ClusterSpec

HOST_PLACEHOLDER = "{host}"


def check_hosts(hosts, host_command, num_tasks: int) -> "list[str] | None":
    """``hosts`` as a list of addresses (one per task), checked; ``None`` for local tasks.

    >>> check_hosts(["10.0.0.1", "10.0.0.2"], "ssh {host}", 2)
    ['10.0.0.1', '10.0.0.2']
    """
    if hosts is None:
        if host_command is not None:
            raise ValueError(
                "`host_command` places tasks on `hosts`, but no hosts were given. "
                f"Received: hosts=None, host_command={host_command!r}"
            )
        return None
    hosts = [hosts] if isinstance(hosts, str) else list(hosts)
    if len(hosts) != num_tasks or not all(isinstance(h, str) and h.strip() for h in hosts):
        raise ValueError(
            f"`hosts` must give one address per task ({num_tasks}: chief, workers, then "
            f"ps, in that order). Received: hosts={hosts!r}"
        )
    if not isinstance(host_command, str) or HOST_PLACEHOLDER not in host_command:
        raise ValueError(
            "Tasks on `hosts` need `host_command`, a command line that runs the rest on "
            f"the host named by {HOST_PLACEHOLDER} (for example 'ssh {HOST_PLACEHOLDER}'). "
            f"Received: host_command={host_command!r}"
        )
    return [h.strip() for h in hosts]


def host_prefixes(cluster_spec, host_command) -> dict:
    """Each task's command prefix (``[]`` for a local task), keyed by ``(task_type, id)``.

    >>> host_prefixes({"worker": ["10.0.0.1:2000", "10.0.0.2:2000"]}, "ssh -q {host}")
    {('worker', 0): ['ssh', '-q', '10.0.0.1'], ('worker', 1): ['ssh', '-q', '10.0.0.2']}
    """
    cluster = ClusterSpec(cluster_spec).as_dict()
    return {
        (job, index): [] if host_command is None else _prefix(host_command, cluster[job][index])
        for job, index in task_keys(cluster)
    }


def host_of(address: str) -> str:
    """The host of a ``host:port`` address.

    >>> host_of("10.0.0.1:2000")
    '10.0.0.1'
    """
    return address.rsplit(":", 1)[0]


def _prefix(host_command: str, address: str) -> list:
    """``host_command``'s words, ``{host}`` standing for ``address``'s host."""
    host = host_of(address)
    return [part.replace(HOST_PLACEHOLDER, host) for part in shlex.split(host_command)]


def on_host(prefix: list, bootstrap: str, command: list, env: dict) -> list:
    """``command`` (this interpreter's) started by ``bootstrap`` on the host of ``prefix``.

    The task gets the variables of ``env`` that this process lacks, and lives as long as
    what ``prefix`` started there.

    >>> argv = on_host(["ssh", "h1"], "/b.py", [sys.executable, "t.py"], {"TF_CONFIG": "{}"})
    >>> argv[:3] == ["ssh", "h1", sys.executable], argv[-4:-1]
    (True, ['parent', 'exec', '--payload'])
    """
    added = {k: v for k, v in env.items() if os.environ.get(k) != v}
    # Isolated and without site-packages, as a local task's bootstrap (``with_bootstrap``).
    interpreter = [sys.executable, "-I", "-S", bootstrap]
    return [*prefix, *interpreter, "parent", "exec", *pack(added, command[1:])]


# Run on each host (standard library only): can it open a TCP connection to each target?
# A refused connection counts as reached: the host answered.
_PROBE = """
import json, socket, sys
reached = []
for host, port in json.loads(sys.argv[1]):
    try:
        socket.create_connection((host, port), float(sys.argv[2])).close()
        reached.append(True)
    except ConnectionRefusedError:
        reached.append(True)
    except OSError:
        reached.append(False)
print(json.dumps(reached))
"""


def unreachable_hosts(host_command: str, addresses: list, timeout: float = 3.0) -> set:
    """The indices of ``addresses`` (``host:port``) that most of the other hosts cannot reach.

    Each host probes every other from where it is (started through ``host_command``,
    all at once); a host whose probe cannot even start there counts as reaching
    nothing. Host ``j`` is unreachable when more than half of the other hosts could not
    reach it. When half of the hosts or more would be, the network, not a host, is
    broken (two hosts that lost each other cannot tell which is gone): none is named.
    """
    targets = [(host_of(address), int(address.rsplit(":", 1)[1])) for address in addresses]
    probes = []
    for address in addresses:
        probe = [sys.executable, "-I", "-S", "-c", _PROBE, json.dumps(targets)]
        command = [*_prefix(host_command, address), *probe]
        probes.append(
            subprocess.Popen(
                [*command, str(timeout)],
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.DEVNULL,
                start_new_session=True,
            )
        )
    reports = [_report(probe, len(targets), timeout + 30.0) for probe in probes]
    unreachable = set()
    for j in range(len(targets)):
        votes = [reports[i][j] for i in range(len(targets)) if i != j]
        if votes and votes.count(False) * 2 > len(votes):
            unreachable.add(j)
    return unreachable if len(unreachable) * 2 < len(targets) else set()


def _report(probe, count: int, timeout: float) -> list:
    """A probe's answers; ``[False] * count`` when it could not run there, or did not end."""
    try:
        out, _ = probe.communicate(timeout=timeout)
        reached = json.loads(out) if probe.returncode == 0 else None
    except (subprocess.TimeoutExpired, ValueError):
        probe.kill()
        probe.wait()
        reached = None
    if not isinstance(reached, list) or len(reached) != count:
        return [False] * count
    return [bool(r) for r in reached]
