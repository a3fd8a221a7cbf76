"""An optimizer update on its ps task: the program the coordinator traced, loaded and run.

The coordinator traces an optimizer's update of the variables one ps task holds
into a ``jax.export`` program (``scheduling/_update_tracing.py``) and sends it
once; the task keeps it here and runs it on its current values for every
worker request that carries gradients for it.
"""

import jax


class LoadedUpdate:
    """An ``UpdateProgram`` on its ps task: ``run`` gives the new values to store."""

    def __init__(self, header: dict, blob: bytes):
        exported = jax.export.deserialize(bytearray(blob))
        self.held = list(header["held"])
        self.written = list(header["written"])
        self._call = jax.jit(exported.call)
        self._cpu = jax.devices("cpu")[0]

    def run(self, held_values: list, arrays: list) -> list:
        """``[(key, new value)]`` from the stored ``held_values`` and the worker's arrays."""
        with jax.default_device(self._cpu):
            outputs = self._call(*held_values, *arrays)
        # Kept as JAX arrays: the next update takes them without a copy.
        return [(self.held[n], out) for n, out in zip(self.written, outputs)]
