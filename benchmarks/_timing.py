"""How the benchmarks time a run: wall-clock steps a second of one call of ``run``."""

import time


def steps_per_second(run, steps: int) -> float:
    """``steps`` over the seconds one call of ``run`` (which runs them) takes.

    >>> steps_per_second(lambda: None, 10) > 0
    True
    """
    start = time.perf_counter()
    run()
    return steps / (time.perf_counter() - start)
