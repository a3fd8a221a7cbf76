"""Selects Keras's JAX backend before Keras is imported.

keras_dist runs on JAX only. Keras reads ``KERAS_BACKEND`` once, when it is
first imported, so the choice has to be made here, before any other module of
this package imports Keras.
"""

import os
import sys

_FIX = (
    "keras_dist runs on Keras's JAX backend. Import keras_dist before keras, or "
    "set KERAS_BACKEND=jax in the environment before Python starts."
)


def ensure_jax_backend() -> None:
    """Sets ``KERAS_BACKEND=jax`` when unset; refuses another backend."""
    requested = os.environ.get("KERAS_BACKEND")
    if "keras" in sys.modules:
        # Imported here: importing Keras before KERAS_BACKEND is set would pick its default.
        import keras

        active = keras.backend.backend()
        if active != "jax":
            raise ImportError(f"{_FIX} Received: keras backend={active!r}.")
        return
    if requested not in (None, "jax"):
        raise ImportError(f"{_FIX} Received: KERAS_BACKEND={requested!r}.")
    os.environ["KERAS_BACKEND"] = "jax"
