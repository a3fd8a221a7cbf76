"""Keras saving under a strategy: its skip-sets are built once, outside any strategy."""

import functools

from keras_dist import _context
from keras_dist._keras._internals import saving_lib


def install_saving_hook() -> None:
    """Builds Keras's saving skip-sets once, outside any strategy.

    ``saving_lib.get_attr_skipset`` caches under one key and looks under another
    (Keras 3.15), so every save builds reference objects again, among them an
    ``Optimizer`` whose variables, created under the strategy, would join its
    state and make the next step compile again (and, across processes, take a
    collective to sync). Here each skip-set is built once, with no strategy.
    """
    original = saving_lib.get_attr_skipset
    if getattr(original, "_keras_dist_hook", False):
        return
    cache: dict = {}

    @functools.wraps(original)
    def get_attr_skipset(obj_type):
        if obj_type not in cache:
            with _context.outside_any_strategy():
                cache[obj_type] = original(obj_type)
        return cache[obj_type]

    get_attr_skipset._keras_dist_hook = True
    saving_lib.get_attr_skipset = get_attr_skipset
