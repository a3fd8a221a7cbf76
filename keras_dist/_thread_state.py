"""Per-thread settings made for the length of a ``with`` block.

>>> import threading
>>> state = threading.local()
>>> state.mode = "off"
>>> with set_for_block(state, "mode", "on"):
...     state.mode
'on'
>>> state.mode
'off'
"""

import contextlib


@contextlib.contextmanager
def set_for_block(state, name: str, value):
    """Sets ``state.<name>`` to ``value`` inside the block, and back to what it was after."""
    previous = getattr(state, name)
    setattr(state, name, value)
    try:
        yield value
    finally:
        setattr(state, name, previous)
