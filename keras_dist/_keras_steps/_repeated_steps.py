"""``fit``'s, ``evaluate``'s and ``predict``'s steps on batches of a layout they ran
before, without ``strategy.run``'s work.

Keras's loop calls one step on batch after batch of one layout. Through
``strategy.run`` each step splits its batch, flattens and sorts the inputs and
builds the program's cache key: about 50 µs of host time, a few percent of a
small model's step. After a layout's first batch ran that way, its program is
kept with the layout (structure, shapes and dtypes of the NumPy batch), and the
next batches of that layout go to it as stacked rows directly. Anything else
(another layout, a partial batch, a changed variable set, a trace in progress,
several processes) goes through ``strategy.run`` as before.
"""

import contextlib

import jax

from keras_dist._capabilities import MeshRuntime
from keras_dist._engine import MISSED
from keras_dist._input import splits_evenly
from keras_dist._input import stacked_rows
from keras_dist._keras_steps import _device_ahead


class RepeatedSteps:
    """Kept step programs by ``(step name, batch layout)``; one per model and strategy.

    >>> import keras_dist as kd
    >>> import numpy as np
    >>> steps = RepeatedSteps(kd.OneDeviceStrategy("/cpu:0").extended)
    >>> steps.run("train", (np.zeros((4, 2)),)) is MISSED  # no layout has run yet
    True
    """

    def __init__(self, extended):
        self._extended = extended
        self._replicas = extended.num_replicas_in_sync
        # Several processes place their rows of a batch as a global array (not here).
        self._enabled = isinstance(extended, MeshRuntime) and not extended.spans_processes
        self._calls: dict = {}  # layout key -> RepeatCall, or None where none applies
        # Whether ``fit`` puts batches' rows on these devices a step ahead (accelerators).
        self._rows_ahead = self._enabled and _device_ahead.puts_ahead(extended)

    def run(self, name: str, data, within=contextlib.nullcontext):
        """Step ``name``'s results on ``data``, or ``MISSED`` where its layout has no program.

        The program runs within the context ``within()`` (``fit`` lets it run on).
        """
        if not self._enabled:
            return MISSED
        leaves, key = self._layout(name, data)
        call = self._calls.get(key) if key is not None else None
        if call is None:
            return MISSED
        stacked = None
        if self._rows_ahead:
            stacked = _device_ahead.PLACED_AHEAD.take(leaves, self._extended.placement.split)
        if stacked is None:  # (rows put on the devices a step ahead: ``_device_ahead``)
            stacked = stacked_rows(leaves, self._replicas)
        with within():
            result = self._extended.run_again(call, stacked)
        if result is MISSED:
            del self._calls[key]  # variables changed: ``strategy.run`` builds anew
        return result

    def learn(self, name: str, data, fn, args) -> None:
        """Keeps the program ``strategy.run(fn, args)`` just ran on ``data`` for its layout."""
        if not self._enabled:
            return
        _, key = self._layout(name, data)
        if key is None or key in self._calls:
            return
        call = self._extended.repeat_call(fn, args)
        self._calls[key] = call
        if len(self._calls) > _MAX_LAYOUTS:
            del self._calls[next(iter(self._calls))]

    def _layout(self, name, data):
        """``data``'s leaves and its layout key; ``None`` unless every leaf is a NumPy array
        of rows that split evenly between the replicas."""
        leaves, treedef = jax.tree_util.tree_flatten(data)
        if not splits_evenly(leaves, self._replicas):
            return leaves, None
        return leaves, (name, treedef, tuple((x.shape, x.dtype) for x in leaves))


_MAX_LAYOUTS = 16  # more layouts than this are rare (one per batch shape): oldest forgotten
