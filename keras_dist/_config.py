"""Global switches of keras_dist (``keras_dist.config``)."""

_run_eagerly = False


def run_functions_eagerly(run_eagerly: bool) -> None:
    """Runs ``strategy.run`` functions eagerly, one thread per replica, for debugging.

    Eager replicas can ``print`` real values and stop in ``pdb``; results are
    the same as the compiled engine's, only slower.

    >>> import keras_dist as kd
    >>> kd.config.run_functions_eagerly(True)
    >>> kd.config.functions_run_eagerly()
    True
    >>> kd.config.run_functions_eagerly(False)
    """
    global _run_eagerly
    _run_eagerly = bool(run_eagerly)


def functions_run_eagerly() -> bool:
    """Whether ``run_functions_eagerly(True)`` is in effect."""
    return _run_eagerly
