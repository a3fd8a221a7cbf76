"""Which failed task a run's error names: the one that failed first, not its victims.

When one task of a collective dies, its peers fail soon after, each with keras_dist's
``UnavailableError`` naming the task it lost (``Lost contact with worker 2 ...``) and exit
status 1. The launcher's error, and an elastic launch's choice of the machine to leave out,
must name the task that failed first: blaming a healthy survivor would drop a good machine
and keep the dead one.

A task whose log reports a lost peer that failed too is that peer's victim, whatever the
times say (a hung peer fails late), and is not blamed. When every failed task reports
another (a host cut off from the network reports every peer lost, and each peer reports
it), the task most of them report is blamed. Among the rest, each exit's time is
noted by a thread that waits for that one process (``TaskProcess.exited_at``), so exits are
ordered even when the runner's poll finds several at once. Exits less than
``SIMULTANEOUS`` seconds apart count as one moment: a launcher that was descheduled (a
loaded machine) wakes its waiting threads together. Among those, the evidence decides,
strongest first: a task killed by a signal (SIGKILL, SIGSEGV: it died, no peer made it), a
task that failed in its own way (a status other than 1 before a plain 1), and last the
tasks that report a lost peer.
"""

import re
from collections import Counter
from typing import NamedTuple

# Exits this close (seconds) are one moment: above the jitter of the threads that note the
# exits (milliseconds; more on a loaded machine), below the time a peer of a real job takes
# to notice a death, raise and exit (an interpreter's shutdown: hundreds of milliseconds).
# A quicker peer is still told apart, by the evidence.
SIMULTANEOUS = 0.1
# keras_dist's errors for a lost peer (keras_dist.errors); their message names the peer.
_LOST_PEER_ERRORS = ("UnavailableError", "DeadlineExceededError")
_TASK_NAME = re.compile(r"\b(chief|worker|ps|evaluator) (\d+)\b")


class Failure(NamedTuple):
    """One failed task: its key, when it exited, its exit code and the end of its log."""

    key: tuple
    exited_at: float
    exit_code: int
    log_tail: str = ""

    @property
    def name(self) -> str:
        return f"{self.key[0]} {self.key[1]}"


def first_failure(failures: list) -> tuple:
    """The key of the task to blame among ``failures`` (``Failure``s, at least one).

    >>> killed = Failure(("worker", 2), 10.03, -9)
    >>> victim = Failure(("worker", 0), 10.0, 1, "UnavailableError: Lost contact with worker 2")
    >>> first_failure([victim, killed])  # one moment: the kill is the cause
    ('worker', 2)
    >>> first_failure([victim, killed._replace(exited_at=10.5)])  # named by worker 0
    ('worker', 2)
    >>> first_failure([victim._replace(log_tail=""), killed._replace(exited_at=10.5)])
    ('worker', 0)
    >>> cut_off = Failure(("worker", 2), 9.0, 1, "UnavailableError: worker 0, worker 1 lost")
    >>> other = Failure(("worker", 1), 10.0, 1, "UnavailableError: worker 2 lost")
    >>> first_failure([victim, other, cut_off._replace(exited_at=10.0)])  # named by both
    ('worker', 2)
    """
    failed = {failure.name for failure in failures}
    # Victims of a failed peer step aside.
    candidates = [f for f in failures if not lost_peers(f) & failed]
    if not candidates:  # every failure names another: a circle
        candidates = _most_named(failures, failed)
    earliest = min(failure.exited_at for failure in candidates)
    together = [f for f in candidates if f.exited_at - earliest <= SIMULTANEOUS]
    if len(together) == 1:
        return together[0].key
    return min(together, key=lambda f: (_rank(f), f.exited_at, f.key)).key


def _most_named(failures: list, failed: set) -> list:
    """The failures the most others report lost (a host cut off names every peer, and
    every peer names it alone); all of them when that is not one task."""
    votes = Counter(name for f in failures for name in lost_peers(f) & failed)
    most = max(votes.values())
    named = [f for f in failures if votes[f.name] == most]
    return named if len(named) == 1 else failures


def lost_peers(failure: Failure) -> set:
    """The tasks that ``failure``'s log reports lost, by name (itself left out).

    >>> sorted(lost_peers(Failure(("worker", 1), 0.0, 1,
    ...     "keras_dist.errors.UnavailableError: Lost contact with worker 0, worker 2 during")))
    ['worker 0', 'worker 2']
    """
    names = set()
    for line in failure.log_tail.splitlines():
        if any(error in line for error in _LOST_PEER_ERRORS):
            names.update(f"{job} {index}" for job, index in _TASK_NAME.findall(line))
    names.discard(failure.name)
    return names


def _rank(failure: Failure) -> int:
    """How strongly the evidence says ``failure`` came first: 0 most, 3 least."""
    if any(error in failure.log_tail for error in _LOST_PEER_ERRORS):
        return 3  # it reports a lost peer: a victim
    if failure.exit_code < 0:
        return 0  # it died: no peer made it
    return 1 if failure.exit_code != 1 else 2
