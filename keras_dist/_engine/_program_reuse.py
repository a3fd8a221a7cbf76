"""A compiled program kept when the strategy's variable set changes around it.

The compiled engine's programs thread every variable of their strategy, and a
program's cache key holds the strategy's variable version: a trace cannot know
beforehand which variables the function reads. So creating any variable in the
scope (a second model, a metric) changes the version, and each program of the
strategy would be compiled again at its next call: ``fit`` of a small CNN on 2
CPU devices took 1.6 s instead of 0.03 s after another model was built beside
it, and on an accelerator a large model's compile takes minutes.

The function is still traced again, as it may now read other variables, but
with the variables the kept program threads. When that trace is the kept
program's own (it read or created no other variable, and has the same jaxpr,
constants, outputs and writes), the kept program is the right one and runs as
it is; otherwise the engine builds a new one as before.

>>> import jax, jax.numpy as jnp
>>> def fingerprint(scale):
...     traced = jax.jit(lambda x: x * scale).trace(jnp.ones(2))
...     return ProgramFingerprint(traced.jaxpr, "outputs")
>>> fingerprint(2.0) == fingerprint(2.0), fingerprint(2.0) == fingerprint(3.0)
(True, False)
"""

import hashlib

import numpy as np


class ProgramFingerprint:
    """What makes two traces one program: the jaxpr's text and constants, and
    ``records`` (what the engine noted beside it: the outputs' layout, the writes).

    The text holds the program's operations, shapes, literals and control flow;
    arrays it closed over are its constants, compared by their bytes as they were
    when traced (a NumPy constant is a view of the caller's array, which may change).
    """

    def __init__(self, closed_jaxpr, *records):
        digest = hashlib.sha256(str(closed_jaxpr.jaxpr).encode())
        try:
            for constant in closed_jaxpr.consts:
                constant = np.ascontiguousarray(constant)
                digest.update(f"{constant.dtype}{constant.shape}".encode())
                digest.update(constant.view(np.uint8).reshape(-1) if constant.size else b"")
            self.digest = digest.digest()
        except (TypeError, ValueError):  # (a constant NumPy cannot hold: a typed PRNG key)
            self.digest = None  # equal to no other: such a program is compiled again
        self.records = records

    def __eq__(self, other) -> bool:
        if not isinstance(other, ProgramFingerprint):
            return NotImplemented
        return (
            self.digest is not None
            and self.digest == other.digest
            and _same(self.records, other.records)
        )

    __hash__ = None  # (compared, never a key)


def _same(a, b) -> bool:
    """Whether two records (nested lists and tuples of flags, tree definitions, marker
    objects and Python constants) are equal, without asking arrays for truth."""
    if a is b:
        return True
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(map(_same, a, b))
    if type(a) is not type(b) or isinstance(a, (np.ndarray, np.generic)):
        return False
    try:
        return (a == b) is True
    except Exception:  # noqa: BLE001 - an object that cannot compare is not the same
        return False
