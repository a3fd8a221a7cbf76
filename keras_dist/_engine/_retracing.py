"""Warns, as ``tf.function`` does, when a replica function is traced again and again.

Tracing and compiling costs far more than a step: a function traced on most
calls runs many times slower, silently. TF warns when 5 of the last calls of
a function triggered retracing; so do we, and we name the likely cause.

>>> monitor = RetraceMonitor()
>>> with warnings.catch_warnings(record=True) as caught:
...     warnings.simplefilter("always")
...     for _ in range(6):
...         monitor.record("step", traced=True, cause="arguments with new shapes or dtypes")
>>> [str(w.message).split('.')[0] for w in caught]
['5 of the last 5 calls to step triggered retracing']
"""

import collections
import warnings

_THRESHOLD = 5  # TF's FREQUENT_TRACING_WARNING_THRESHOLD
_HISTORY = 10


class RetracingWarning(UserWarning):
    """A replica function was traced and compiled on most of its recent calls."""


class RetraceMonitor:
    """Counts traces per function (by code) over its recent calls; warns once per function."""

    def __init__(self):
        self._history: dict = {}
        self._last_traced: dict = {}  # code -> the (key, statics, signature) last traced
        self._warned: set = set()

    def hit(self, code) -> None:
        """A call that found its program (cheap: it runs on every step)."""
        history = self._history.get(code)
        if history is not None:
            history.append(False)

    def traced(self, code, traced_key) -> None:
        """A call that traced; ``traced_key`` is ``(function key, statics, signature)``."""
        cause = retrace_cause(self._last_traced.get(code), traced_key)
        self._last_traced[code] = traced_key
        self.record(code, traced=True, cause=cause)

    def record(self, code, traced: bool, cause: str = "") -> None:
        history = self._history.setdefault(code, collections.deque(maxlen=_HISTORY))
        history.append(traced)
        if not traced or code in self._warned:
            return
        traces = sum(history)
        if traces >= _THRESHOLD:
            self._warned.add(code)
            name = getattr(code, "co_qualname", getattr(code, "__qualname__", code))
            warnings.warn(
                f"{traces} of the last {len(history)} calls to {name} triggered retracing. "
                "Tracing and compiling is expensive: each such call runs many times slower "
                f"than a cached one. The likely cause: {cause}. Define the function once, "
                "outside the loop (or decorate the step that calls `strategy.run` with "
                "`@kd.function`), pass arrays rather than Python values for what changes "
                "between calls, and keep shapes fixed (a partial last batch traces once more).",
                RetracingWarning,
                stacklevel=5,
            )


def retrace_cause(previous, current) -> str:
    """Why a function was traced again, from its last traced ``(key, statics, signature)``."""
    if previous is None:
        return "a first call"
    key, statics, signature = previous
    if key != current[0]:
        return "a new function object (or new captured objects) on each call"
    if signature != current[2]:
        return "arguments with new shapes or dtypes"
    if statics != current[1]:
        return "new Python values (numbers, strings, objects) as arguments"
    return "new variables created since the last call"
