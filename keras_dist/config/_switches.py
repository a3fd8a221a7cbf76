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
    """Whether ``run_functions_eagerly(True)`` is in effect.

    >>> import keras_dist as kd
    >>> kd.config.run_functions_eagerly(True)
    >>> kd.config.functions_run_eagerly()
    True
    >>> kd.config.run_functions_eagerly(False)
    """
    return _run_eagerly


_prefetch_buffer_size = 2


def set_prefetch_buffer_size(batches: int) -> None:
    """How many batches ``fit``/``evaluate``/``predict`` read ahead under a strategy.

    Reading runs on a background thread while the current step computes, so
    an input pipeline that waits on storage overlaps the training; 0 reads
    each batch when it is needed.

    >>> import keras_dist as kd
    >>> kd.config.set_prefetch_buffer_size(4)
    >>> kd.config.prefetch_buffer_size()
    4
    >>> kd.config.set_prefetch_buffer_size(2)
    """
    global _prefetch_buffer_size
    if not isinstance(batches, int) or batches < 0:
        raise ValueError(
            f"The prefetch buffer size must be an integer >= 0. Received: batches={batches!r}"
        )
    _prefetch_buffer_size = batches


def prefetch_buffer_size() -> int:
    """The number of batches ``fit`` reads ahead (see ``set_prefetch_buffer_size``).

    >>> import keras_dist as kd
    >>> kd.config.prefetch_buffer_size()
    2
    """
    return _prefetch_buffer_size
