"""Switches that change how keras_dist runs replica functions."""

from keras_dist.config._switches import functions_run_eagerly as functions_run_eagerly
from keras_dist.config._switches import prefetch_buffer_size as prefetch_buffer_size
from keras_dist.config._switches import run_functions_eagerly as run_functions_eagerly
from keras_dist.config._switches import set_prefetch_buffer_size as set_prefetch_buffer_size

__all__ = [
    "functions_run_eagerly",
    "prefetch_buffer_size",
    "run_functions_eagerly",
    "set_prefetch_buffer_size",
]
