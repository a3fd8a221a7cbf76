"""Whether code runs in a JAX trace keras_dist opened, or in one a JAX loop opened in it.

``keras.ops.fori_loop``, ``while_loop`` and ``scan`` (and ``jax.lax``'s loops,
``jax.jit``, ``jax.vmap``) trace their body once, in a trace of their own. A
``strategy.run`` there would run its replicas once for every iteration: the
step's variable updates would escape the loop and be lost, and ``next(iterator)``
would hand every iteration the same batch. TF's ``for _ in tf.range(steps)``
loop is ported as a Python ``for`` loop inside a ``kd.function`` (unrolled into
one program); these checks say so instead of giving wrong numbers.

JAX has no public way to ask which trace is current, so this reads its trace
context, and checks nothing where a JAX version has none.
"""

# JAX's current trace has no public accessor (jax.core exposes Trace and Tracer only).
from jax._src import core as jax_core

_FIX = (
    "Write the loop as a Python `for` loop inside a `@kd.function` (it is unrolled into "
    "one program, as TF's `for _ in tf.range(steps)` loop is ported), and decorate the "
    "step with `@kd.function` rather than `jax.jit`"
)


# Looked up once: every `strategy.run` asks (about half a microsecond then).
_TRACE_CONTEXT = getattr(jax_core, "trace_ctx", None)
_EVAL_TRACE = getattr(jax_core, "EvalTrace", None)


def current_trace():
    """The JAX trace code runs in now, or ``None`` where this JAX version does not say."""
    return getattr(_TRACE_CONTEXT, "trace", None)


def outside_any_trace() -> bool:
    """Whether code runs eagerly (no JAX trace), or this JAX version does not say."""
    trace = current_trace()
    return trace is None or _EVAL_TRACE is None or isinstance(trace, _EVAL_TRACE)


def refuse_foreign_trace(what: str, expected=None) -> None:
    """Raises if ``what`` runs in a JAX trace other than ``expected`` (``None``: no trace).

    ``expected`` is the trace a ``kd.function``'s body runs in.
    """
    if expected is None:
        if outside_any_trace():
            return
    elif current_trace() in (None, expected):
        return
    raise RuntimeError(
        f"{what} was called inside a JAX transformation keras_dist does not see into: "
        "the body of `keras.ops.fori_loop`, `while_loop` or `scan` (or of `jax.lax`'s "
        "loops, `jax.jit`, `jax.vmap`) is traced once for all its iterations, so a "
        "step's variable updates would be lost and `next(iterator)` would give every "
        f"iteration the same batch. {_FIX}. Received: a call in {type(current_trace()).__name__}"
    )
