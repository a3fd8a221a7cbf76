"""TensorFlow calls left in a ported step, said plainly where keras_dist traces it.

A TF tutorial's replica function often still calls TensorFlow ops (``tf.add_n``,
``tf.cast(tf.greater(x, 0), tf.float32)``). ``strategy.run`` and ``kd.function``
trace the function with JAX, and the op fails converting JAX's traced array, with
JAX's ``TracerArrayConversionError`` naming neither the op nor the fix. A step still
decorated with ``@tf.function`` makes TensorFlow trace keras_dist itself into its
graph, which fails converting TF's symbolic tensors (or, with no tensor argument,
keeps only what the first trace computed). ``explains_tensorflow_calls`` decorates
those two entry points and turns both into errors that name the op and its
``keras.ops`` counterpart, or ``@kd.function``.

TensorFlow is never imported here: its frames are recognised by their module's
name, and a graph trace is asked of TensorFlow only when the program imported it.
"""

import ast
import functools
import linecache
import sys
import traceback
import types

import jax
import keras

# What a TF op raises when it converts a JAX tracer (np.asarray, int(), bool()).
_TRACER_ERRORS = (
    jax.errors.TracerArrayConversionError,
    jax.errors.ConcretizationTypeError,
    jax.errors.TracerIntegerConversionError,
)

# TF ops whose keras.ops counterpart has another name; the others keep theirs.
_REPLACEMENTS = {
    "add_n": "`keras.ops.sum(keras.ops.stack(inputs), axis=0)` (or Python's `sum(inputs)`)",
    "concat": "`keras.ops.concatenate`",
    "constant": "`keras.ops.convert_to_tensor` (or a NumPy array)",
    "gather": "`keras.ops.take`",
    "pow": "`keras.ops.power`",
    "range": "`keras.ops.arange`",
    "rank": "`keras.ops.ndim`",
    "reduce_all": "`keras.ops.all`",
    "reduce_any": "`keras.ops.any`",
    "reduce_logsumexp": "`keras.ops.logsumexp`",
    "reduce_max": "`keras.ops.max`",
    "reduce_mean": "`keras.ops.mean`",
    "reduce_min": "`keras.ops.min`",
    "reduce_prod": "`keras.ops.prod`",
    "reduce_std": "`keras.ops.std`",
    "reduce_sum": "`keras.ops.sum`",
    "reduce_variance": "`keras.ops.var`",
    "compute_average_loss": "`kd.nn.compute_average_loss`",
    "scale_regularization_loss": "`kd.nn.scale_regularization_loss`",
    "sigmoid_cross_entropy_with_logits": (
        "`keras.ops.binary_crossentropy(labels, logits, from_logits=True)`"
    ),
    "softmax_cross_entropy_with_logits": (
        "`keras.ops.categorical_crossentropy(labels, logits, from_logits=True)`"
    ),
    "sparse_softmax_cross_entropy_with_logits": (
        "`keras.ops.sparse_categorical_crossentropy(labels, logits, from_logits=True)`"
    ),
}


# Where a `tf.function` reads its arguments' types (TF 2.13 and later).
_TF_FUNCTION_MODULES = (
    "tensorflow.core.function",
    "tensorflow.python.eager.polymorphic_function",
)


class TensorFlowOpError(TypeError):
    """A TensorFlow op was given a JAX value in a function keras_dist traces."""


def explains_tensorflow_calls(what: str):
    """Decorates the entry point ``what`` (``strategy.run``, a ``kd.function``'s call):
    refuses a call inside a TensorFlow graph trace, and raises ``TensorFlowOpError``,
    JAX's error chained, where a TensorFlow op met a JAX tracer. Other errors pass."""

    def decorate(method):
        @functools.wraps(method)
        def call(*args, **kwargs):
            refuse_tensorflow_graph(what)
            try:
                return method(*args, **kwargs)
            except _TRACER_ERRORS as error:
                explained = tensorflow_op_error(error)
                if explained is None:
                    raise
                raise explained from error

        return call

    return decorate


def refuse_tensorflow_graph(what: str) -> None:
    """Raises if TensorFlow is tracing a graph (a ``tf.function``) around this call."""
    tf = sys.modules.get("tensorflow")
    inside_function = getattr(tf, "inside_function", None)  # (None while TF imports)
    if inside_function is None or not inside_function():
        return
    raise RuntimeError(
        f"{what} was called while TensorFlow traces a `tf.function`. keras_dist runs "
        "on JAX: TensorFlow's graph cannot hold its programs, and would keep only what "
        "its first trace computed. Decorate the function with `@kd.function` instead "
        "of `@tf.function` (it takes the same `input_signature`, `jit_compile` and "
        "`reduce_retracing` arguments). Received: a call inside a TensorFlow graph "
        "(`tf.inside_function()` is True)"
    )


def tensorflow_op_error(error) -> TensorFlowOpError | None:
    """The error to raise for JAX's ``error``, when a TensorFlow op raised it; else ``None``."""
    frames = list(traceback.walk_tb(error.__traceback__))
    first = next((i for i, (frame, _) in enumerate(frames) if _in_tensorflow(frame)), None)
    if first is None:
        return None
    name, site = None, ""
    if any(_in_tensorflow(frame, _TF_FUNCTION_MODULES) for frame, _ in frames[first:]):
        name = "tf.function"  # (it failed reading its JAX arguments)
    if first > 0:
        caller = frames[first - 1][0]
        summary = traceback.extract_tb(error.__traceback__)[first - 1]
        name = name or _called_name(caller, summary)
        line = (summary.line or "").strip()
        site = f"`{line}` at {summary.filename}:{summary.lineno}" if line else ""
        site = site or f"{summary.filename}:{summary.lineno}"
    if name == "tf.function":
        return TensorFlowOpError(
            "A `tf.function` was called with JAX values inside a function keras_dist "
            "traces (`strategy.run` or `@kd.function`): TensorFlow cannot trace JAX's "
            "arrays. Remove `@tf.function` from the replica function (its caller is "
            "compiled already), or decorate it with `@kd.function`. "
            f"Received: {site or 'a call of a tf.function'}"
        )
    op = f"`{name}`" if name else "A TensorFlow op"
    return TensorFlowOpError(
        f"{op} was given a JAX value inside a function keras_dist traces (`strategy.run` "
        "or `@kd.function`): TensorFlow ops cannot take JAX's traced arrays. Use "
        f"{_replacement(name)} instead. Received: {site or 'a call inside TensorFlow'}"
    )


def _in_tensorflow(frame, modules=("tensorflow",)) -> bool:
    name = frame.f_globals.get("__name__") or ""
    return any(_in_module(name, module) for module in modules)


def _replacement(name) -> str:
    if name is None:
        return "the `keras.ops` function of the same name"
    op = name.rsplit(".", 1)[-1]
    if op in _REPLACEMENTS:
        return _REPLACEMENTS[op]
    if callable(getattr(keras.ops, op, None)):
        return f"`keras.ops.{op}`"
    return f"the `keras.ops` (or `jax.numpy`) function that does what `{name}` does"


def _called_name(frame, summary) -> str | None:
    """The TensorFlow function the failing expression calls, as the code names it
    (``tf.math.reduce_sum``), or ``None``."""
    for tree in _parsed(summary):
        # Breadth first: the outermost call of the failing expression comes first.
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and _names_tensorflow_function(frame, node.func):
                return ast.unparse(node.func)
    return None


def _parsed(summary):
    """The failing expression (Python 3.11's column span), then its whole line, parsed."""
    sources = []
    column, end_column = getattr(summary, "colno", None), getattr(summary, "end_colno", None)
    if column is not None and end_column is not None and summary.end_lineno is not None:
        lines = [
            linecache.getline(summary.filename, n).encode()
            for n in range(summary.lineno, summary.end_lineno + 1)
        ]
        # Column offsets count UTF-8 bytes.
        lines[-1] = lines[-1][:end_column]
        lines[0] = lines[0][column:]
        sources.append((b"".join(lines).decode(errors="replace"), "eval"))
    if summary.line:
        sources.append((summary.line.strip(), "exec"))
    trees = []
    for source, mode in sources:
        try:
            trees.append(ast.parse(source, mode=mode))
        except SyntaxError:
            continue
    return trees


def _names_tensorflow_function(frame, func) -> bool:
    """Whether ``func``, an expression of ``frame``, names a TensorFlow function. Only
    TensorFlow's modules are looked into: nothing of the user's runs."""
    chain = []
    while isinstance(func, ast.Attribute):
        chain.append(func.attr)
        func = func.value
    if not isinstance(func, ast.Name):
        return False
    scopes = (frame.f_locals, frame.f_globals, frame.f_builtins)
    value = next((scope[func.id] for scope in scopes if func.id in scope), None)
    for attribute in reversed(chain):
        if not (isinstance(value, types.ModuleType) and _tensorflow_module(value.__name__)):
            return False
        value = getattr(value, attribute, None)
    if isinstance(value, types.ModuleType) or not callable(value):
        return False
    return _tensorflow_module(getattr(value, "__module__", None) or "")


def _tensorflow_module(name: str) -> bool:
    return _in_module(name, "tensorflow")


def _in_module(name: str, package: str) -> bool:
    return name == package or name.startswith(package + ".")
