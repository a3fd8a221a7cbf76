"""Switches that change how keras_dist runs replica functions."""

from keras_dist._config import functions_run_eagerly as functions_run_eagerly
from keras_dist._config import run_functions_eagerly as run_functions_eagerly

__all__ = ["functions_run_eagerly", "run_functions_eagerly"]
