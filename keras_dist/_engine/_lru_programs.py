"""``ProgramCache``: the compiled engines' programs by key, least recently used dropped."""

import collections


class ProgramCache:
    """Compiled programs by key, the least recently used dropped beyond ``size``.

    A key starts with the program's ``FunctionKey`` (see ``program_key``), so the
    programs of functions that are gone can be forgotten.

    >>> cache = ProgramCache(size=1)
    >>> cache.put("a", 1); cache.put("b", 2)
    >>> cache.get("a"), cache.get("b")
    (None, 2)
    """

    def __init__(self, size: int):
        self._programs: collections.OrderedDict = collections.OrderedDict()
        self._size = size
        self._newest = None  # the program at the end of the order

    def get(self, key):
        program = self._programs.get(key)
        if program is not None and program is not self._newest:
            self._programs.move_to_end(key)  # a second lookup: not when it is last already
            self._newest = program
        return program

    def put(self, key, program) -> None:
        self._programs[key] = program
        self._newest = program
        if len(self._programs) > self._size:
            self._programs.popitem(last=False)

    def discard(self, key) -> None:
        self._programs.pop(key, None)
        self._newest = None

    def drop_dead_functions(self) -> None:
        """Forgets programs of functions that are gone (their model was dropped)."""
        for key in [k for k in self._programs if not k[0].alive]:
            del self._programs[key]
        self._newest = None

    def newest_of(self, base):
        """The newest program whose key is ``base`` and two more fields (``program_key``'s
        strategy variable version and foreign count), or ``None``."""
        for key in reversed(self._programs):
            if key[:-2] == base:
                return self._programs[key]
        return None

    def values(self) -> list:
        return list(self._programs.values())
