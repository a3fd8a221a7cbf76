"""What a scheduled function sees while the coordinator traces it for the workers.

A function given to ``ClusterCoordinator.schedule`` is traced once per input
signature on the coordinator, with every parameter-server variable's value a
traced input, and the resulting program runs on the workers. While it is
traced, ``ProgramTrace`` records how each variable is written (``assign_add``
and ``assign_sub`` compose across workers, ``assign`` overwrites), counts
``next()`` calls on per-worker iterators, and stands for the worker's index.
"""

import threading

from keras_dist._thread_state import set_for_block


class ProgramTrace:
    """The state of one trace of a scheduled function."""

    def __init__(self, worker_index):
        self.worker_index = worker_index
        self.kinds: dict = {}  # id(variable) -> "add" while only added to, else "assign"
        # Variables an optimizer updates on the worker (its update cannot run on
        # a ps task): their new values go back as deltas, so that concurrent
        # workers' updates of a slot add up instead of overwriting each other.
        self.deltas: set = set()

    def note_write(self, variable, kind: str) -> None:
        """Records a write; a variable only added to (or subtracted from) sends its delta."""
        previous = self.kinds.get(id(variable), "add")
        self.kinds[id(variable)] = "add" if (kind == "add" and previous == "add") else "assign"


class _State(threading.local):
    def __init__(self):
        self.trace = None
        self.worker_index = None  # on a worker, while its dataset function runs


_state = _State()


def current_trace() -> "ProgramTrace | None":
    """The scheduled function being traced on this thread, if any."""
    return _state.trace


def tracing(trace: ProgramTrace):
    """Marks the block as the trace of a scheduled function."""
    return set_for_block(_state, "trace", trace)


def on_worker(worker_index: int):
    """Marks code running on worker ``worker_index`` (its dataset function)."""
    return set_for_block(_state, "worker_index", worker_index)


def current_worker_index():
    """The worker index inside a scheduled function or a per-worker dataset function.

    In a scheduled function it is a traced integer (the program runs on any
    worker); in a dataset function, the worker's index. ``None`` elsewhere.
    """
    if _state.trace is not None:
        return _state.trace.worker_index
    return _state.worker_index


def used_inputs(jaxpr, count: int) -> set:
    """Indices of the first ``count`` inputs of ``jaxpr`` that anything uses."""
    used = set()
    for eqn in jaxpr.eqns:
        used.update(v for v in eqn.invars if not hasattr(v, "val"))
    used.update(v for v in jaxpr.outvars if not hasattr(v, "val"))
    return {n for n, v in enumerate(jaxpr.invars[:count]) if v in used}
