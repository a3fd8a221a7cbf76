"""Saving before a preemption: every process stops at the same batch, saves, and exits.

tf.distribute's ``PreemptionCheckpointHandler`` watches for ``SIGTERM``, lets
the workers agree on a step, saves a checkpoint there and exits with a code the
platform restarts on. Its default outside Google Cloud is 42, kept here.

* One process: a Python ``SIGTERM`` handler, installed only while ``fit``
  runs, records the signal; the next batch end saves and exits.
* Several processes: JAX's preemption notifier records ``SIGTERM`` and its
  sync manager tells every process the same batch to stop at, through
  ``multihost_utils.reached_preemption_sync_point``, asked at every batch end.
  The notifier hears ``SIGTERM`` only while such a ``fit`` runs: keras_dist
  takes the signal back from it when it starts ``jax.distributed`` (otherwise
  SIGTERM would never end the process; ``docs/architecture.md``, "A jaxlib hazard"), and hands it
  over here for the length of the ``fit``.
"""

import itertools
import signal
import sys
import threading

import jax
from jax.experimental import multihost_utils

from keras_dist import _distributed_runtime

PREEMPTION_EXIT_CODE = 42

# One id per batch end, the same sequence on every process (they all run the
# same fits): the sync manager needs ids that only grow over the process's life.
_step_ids = itertools.count()


def _is_multi_process() -> bool:
    return jax.process_count() > 1


class PreemptionWatcher:
    """Tells at each batch end whether training must save and stop now.

    Call ``start`` when training begins, ``reached_sync_point`` at every batch
    end on every process, and ``finish`` when training ends.

    >>> watcher = PreemptionWatcher()
    >>> watcher.start()
    >>> watcher.reached_sync_point()
    False
    >>> watcher.finish()
    """

    def __init__(self):
        self._multi_process = False
        self._installed = False
        self._previous = None
        self._received = False
        self._give_sigterm_back = None

    def start(self) -> None:
        """Starts watching: installs the ``SIGTERM`` handler of a single process.

        With several processes, ``SIGTERM`` goes to JAX's preemption notifier instead.
        """
        self._received = False
        self._multi_process = _is_multi_process()
        if self._multi_process:
            self._give_sigterm_back = _distributed_runtime.hand_sigterm_to_preemption_notifier()
            return
        if threading.current_thread() is not threading.main_thread():
            raise RuntimeError(
                "`save_before_preemption=True` needs `fit` to run in the main thread: "
                "Python delivers signals only there. Received: a `fit` in thread "
                f"{threading.current_thread().name!r}"
            )
        self._previous = signal.getsignal(signal.SIGTERM)
        signal.signal(signal.SIGTERM, self._on_sigterm)
        self._installed = True

    def _on_sigterm(self, signum, frame):
        if self._received:
            # A second SIGTERM before a batch ended (a stuck step, or a fit that
            # failed and left the handler behind): stop waiting for one.
            self._restore()
            signal.raise_signal(signum)
            return
        self._received = True

    @property
    def requested(self) -> bool:
        """Whether this process received ``SIGTERM`` during ``fit`` (one process only)."""
        return self._received

    def reached_sync_point(self) -> bool:
        """Whether every process must save and exit at this batch end."""
        step_id = next(_step_ids)
        if self._multi_process:
            return multihost_utils.reached_preemption_sync_point(step_id)
        return self._received

    def _restore(self) -> None:
        give_back, self._give_sigterm_back = self._give_sigterm_back, None
        if give_back is not None:
            give_back()
        if self._installed:
            previous = self._previous if self._previous is not None else signal.SIG_DFL
            signal.signal(signal.SIGTERM, previous)
            self._installed = False

    def exit(self) -> None:
        """Restores the previous handler and exits with ``PREEMPTION_EXIT_CODE``."""
        self._received = False
        self._restore()
        sys.exit(PREEMPTION_EXIT_CODE)

    def finish(self) -> None:
        """Restores the previous handler; a ``SIGTERM`` received since goes to it now.

        Training ended before a batch end could act on the signal (or ``fit``
        failed): the process was still asked to stop.
        """
        received, self._received = self._received, False
        self._restore()
        if received and not self._multi_process:
            signal.raise_signal(signal.SIGTERM)
