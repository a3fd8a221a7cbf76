"""``OpenMPIClusterResolver``: an OpenMPI ``mpirun`` job's cluster, from its ``OMPI_*`` variables.

``mpirun`` gives every rank ``OMPI_COMM_WORLD_SIZE``, ``OMPI_COMM_WORLD_RANK`` and
(OpenMPI 4) ``OMPI_MCA_orte_hnp_uri``, the address of mpirun's own daemon:
``"<jobid>.<vpid>;tcp://<ip>[,<ip>...]:<port>[;tcp6://[<ip6>[,...]]:<port>]"``. Rank 0
runs on mpirun's host when that host is the first of the job's, so that host's first
address is the coordinator's; its port is derived from the job id, the same in every
rank and different for each mpirun job, or taken from ``KERAS_DIST_COORDINATOR_PORT``.
"""

import os
import re

from keras_dist.cluster_resolver._coordinator import CoordinatorClusterResolver

SIZE, RANK, HNP_URI = "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_RANK", "OMPI_MCA_orte_hnp_uri"
PORT_ENV = "KERAS_DIST_COORDINATOR_PORT"
# Derived ports lie in 61440-65535: above Linux's ephemeral range (32768-60999), so an
# outgoing connection has not taken them. An OpenMPI 4 job id is its job family (a 16-bit
# hash of mpirun's host and pid) in the upper 16 bits and the job's number in the family
# in the lower ones, 0 for mpirun's daemons, whose id the URI holds: the family's low 12
# bits pick the port, so two mpirun jobs share one only by a 1-in-4096 chance.
_PORT_FLOOR, _PORT_SPAN, _FAMILY_SHIFT = 61440, 4096, 16
_URI = re.compile(r"(tcp6?)://(?:\[([^\]]+)\]|([^:]+)):(\d+)")


def _ompi_variables(env) -> dict:
    return {name: value for name, value in env.items() if name.startswith("OMPI_")}


def _coordinator_host(uri: str) -> str:
    """The first address of the first ``tcp``/``tcp6`` address list in an HNP URI.

    >>> _coordinator_host("1.0;tcp://10.0.0.1,10.0.0.2:3000;tcp6://[fe80::1,::2]:3001")
    '10.0.0.1'
    >>> _coordinator_host("1.0;tcp6://[fe80::1,2001:db8::2]:3001")
    '[fe80::1]'
    """
    for part in uri.split(";")[1:]:
        match = _URI.fullmatch(part.strip())
        if match:
            kind, six, four = match.group(1), match.group(2), match.group(3)
            first = (six or four).split(",")[0].strip()
            return f"[{first}]" if kind == "tcp6" else first
    raise ValueError(
        f"Cannot find the coordinator's host in OpenMPI's {HNP_URI}: expected "
        '"<jobid>.<vpid>;tcp://<ip>[,<ip>...]:<port>" (or tcp6://[<ip6>]:<port>). '
        f"Received: {HNP_URI}={uri!r}"
    )


def _coordinator_port(uri: str, env) -> int:
    """``KERAS_DIST_COORDINATOR_PORT`` when set, else a port derived from the URI's job id."""
    if env.get(PORT_ENV):
        value = env[PORT_ENV].strip()
        if not value.isdigit() or not 0 < int(value) < 65536:
            raise ValueError(
                f"{PORT_ENV} must be a port number (1-65535). Received: {PORT_ENV}={value!r}"
            )
        return int(value)
    job_id = uri.split(";")[0].split(".")[0].strip()
    if not job_id.isdigit():
        raise ValueError(
            f'OpenMPI\'s {HNP_URI} does not start with "<jobid>.<vpid>;": cannot derive the '
            f"coordinator's port (or set {PORT_ENV}). Received: {HNP_URI}={uri!r}"
        )
    return _PORT_FLOOR + (int(job_id) >> _FAMILY_SHIFT) % _PORT_SPAN


class OpenMPIClusterResolver(CoordinatorClusterResolver):
    """The cluster of an OpenMPI 4 ``mpirun`` job, one process per rank.

    Reads ``OMPI_COMM_WORLD_SIZE`` and ``OMPI_COMM_WORLD_RANK``; the coordinator
    (rank 0, on mpirun's host) is at the first address of ``OMPI_MCA_orte_hnp_uri``,
    on a port derived from the job id (61440-65535), or on
    ``KERAS_DIST_COORDINATOR_PORT`` when set. Every rank is a ``worker``; its
    ``task_id`` is its rank. ``environ`` replaces ``os.environ``.

    Rank 0 must run on mpirun's host (as it does when that host comes first in
    the host file). Pin the address list to one network with ``mpirun --mca
    oob_tcp_if_include <iface or CIDR>`` when the host's first address is not
    one the other hosts reach.

    >>> env = {"OMPI_COMM_WORLD_SIZE": "2", "OMPI_COMM_WORLD_RANK": "1",
    ...        "OMPI_MCA_orte_hnp_uri": "1147731968.0;tcp://10.0.0.5,192.168.1.5:37407"}
    >>> resolver = OpenMPIClusterResolver(environ=env)
    >>> resolver.coordinator_address, resolver.num_processes, resolver.task_id
    ('10.0.0.5:62569', 2, 1)
    >>> OpenMPIClusterResolver(environ={**env, "KERAS_DIST_COORDINATOR_PORT": "1234"}).master()
    '10.0.0.5:1234'
    """

    def __init__(self, *, environ=None):
        env = os.environ if environ is None else environ
        missing = [name for name in (SIZE, RANK, HNP_URI) if not env.get(name)]
        if missing:
            raise ValueError(
                f"OpenMPI's variables are not all set (is this a rank started by OpenMPI 4's "
                f"mpirun?): missing {missing}. Received: {_ompi_variables(env)!r}"
            )
        size, rank = env[SIZE].strip(), env[RANK].strip()
        if not (size.isdigit() and rank.isdigit() and int(rank) < int(size)):
            raise ValueError(
                f"OpenMPI's {SIZE} and {RANK} must be integers with rank < size. "
                f"Received: {SIZE}={env[SIZE]!r}, {RANK}={env[RANK]!r}"
            )
        uri = env[HNP_URI]
        address = f"{_coordinator_host(uri)}:{_coordinator_port(uri, env)}"
        super().__init__(address, size, rank)

    @staticmethod
    def detect(environ) -> bool:
        """Whether ``environ`` is that of a rank of an ``mpirun`` job of more than one process."""
        size = environ.get(SIZE, "").strip()
        # A size that is not a number is mpirun's all the same: the resolver says what is wrong.
        return bool(size) and (not size.isdigit() or int(size) > 1)
