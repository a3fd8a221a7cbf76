"""``RepeatCall``: one cached program of the compiled engine, run again without a lookup.

A training loop calls one replica function on batch after batch of one layout.
``CompiledEngine.run`` flattens and sorts the inputs and builds the cache key on
every call (tens of µs, a few percent of a small step); a ``RepeatCall`` keeps
the program found once (``CompiledEngine.repeat_call``) and checks only what
would make it the wrong one.
"""

MISSED = object()  # what a ``RepeatCall`` answers when its program no longer applies


class StaleEntry(Exception):
    """A cached program whose variables are gone (built again)."""


class RepeatCall:
    """One cached program, run again on new per-replica inputs of the layout it took.

    It answers ``MISSED`` once the strategy's variable set changed (its
    version, or the foreign variables threaded) or the program's own variables
    are gone; the caller then goes through ``run``, which builds the right one.
    ``key`` is the program's cache key, ``variable_state`` the strategy's, and
    ``foreign`` and ``retraces`` the engine's foreign variables and retrace monitor.
    """

    def __init__(self, entry, key, variable_state, foreign, retraces):
        self._entry = entry
        *_, self._version, self._foreign_count = key
        self._code = key[0].code
        self._variable_state = variable_state
        self._foreign = foreign
        self._retraces = retraces

    def __call__(self, stacked: list):
        """The replica function's results on ``stacked`` (its per-replica inputs, in order)."""
        if (
            self._variable_state().version != self._version
            or len(self._foreign) != self._foreign_count
        ):
            return MISSED
        try:
            result = self._entry(stacked)
        except StaleEntry:
            return MISSED
        self._retraces.hit(self._code)
        return result
