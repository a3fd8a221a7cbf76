"""TensorFlow calls left in a ported step: ``strategy.run`` and ``kd.function`` say which
op met a JAX value and what to use instead; a ``@tf.function`` around them is refused.

The first tests run without TensorFlow: a stand-in module named as TensorFlow's are,
whose ops convert their input with NumPy as TF's do. The last ones use TensorFlow.
"""

import sys
import types

import jax
import numpy as np
import pytest
from conftest import cpus

import keras_dist as kd
from keras_dist._engine._tensorflow_calls import TensorFlowOpError

_STAND_IN_SOURCE = """
import numpy as np

def add_n(inputs):
    return sum(np.asarray(x) for x in inputs)

def greater(x, y):
    return np.asarray(x) > y

def cast(x, dtype):
    return np.asarray(x).astype(dtype)

def reduce_mean(x):
    return np.asarray(x).mean()

def unsorted_segment_sum(x, ids, n):
    return np.asarray(x)
"""


def _stand_in_tensorflow():
    """A module named as TensorFlow's are (its frames look like TF's), not TensorFlow."""
    module = types.ModuleType("tensorflow.stand_in")
    exec(compile(_STAND_IN_SOURCE, "<tensorflow stand-in>", "exec"), module.__dict__)
    return module


tf_ops = _stand_in_tensorflow()

X = np.arange(8, dtype="float32") - 3.0


def _mirrored():
    return kd.MirroredStrategy(cpus(2))


def _raised(call):
    with pytest.raises(TensorFlowOpError) as info:
        call()
    error = info.value
    assert isinstance(error, TypeError)  # what JAX's conversion error is, too
    assert isinstance(error.__cause__, jax.errors.TracerArrayConversionError)
    return str(error)


def test_a_tensorflow_op_in_strategy_run_names_the_op_and_its_keras_ops_counterpart():
    strategy = _mirrored()

    def replica_fn(x):
        return tf_ops.add_n([x, x])

    message = _raised(lambda: strategy.run(replica_fn, (X,)))
    assert message.startswith("`tf_ops.add_n` was given a JAX value inside a function")
    assert "Use `keras.ops.sum(keras.ops.stack(inputs), axis=0)`" in message
    assert f"Received: `return tf_ops.add_n([x, x])` at {__file__}:" in message
    # The strategy runs on: its lock was released, nothing is left half-built.
    result = strategy.run(lambda x: x + x, (X,))
    np.testing.assert_array_equal(np.asarray(strategy.gather(result, axis=0)), np.tile(2 * X, 2))


def test_the_inner_op_that_failed_is_named_and_an_op_of_the_same_name_is_suggested():
    strategy = _mirrored()

    def replica_fn(x):
        return tf_ops.cast(tf_ops.greater(x, 0), "float32")

    message = _raised(lambda: strategy.run(replica_fn, (X,)))
    # Python evaluates the inner call first: that one met the tracer.
    assert message.startswith("`tf_ops.greater` was given a JAX value")
    assert "Use `keras.ops.greater` instead." in message


def test_a_tensorflow_op_in_a_kd_function_says_the_same():
    @kd.function
    def mean(x):
        return tf_ops.reduce_mean(x)

    @kd.function
    def segment_sum(x):
        return tf_ops.unsorted_segment_sum(x, None, 1)

    message = _raised(lambda: mean(X))
    assert message.startswith("`tf_ops.reduce_mean` was given a JAX value")
    assert "Use `keras.ops.mean` instead." in message
    assert "Use the `keras.ops` (or `jax.numpy`) function that does what " in _raised(
        lambda: segment_sum(X)
    )


def test_strategy_run_inside_a_kd_function_is_explained_once():
    strategy = _mirrored()

    @kd.function
    def step(x):
        return strategy.run(lambda y: tf_ops.add_n([y]), (x,))

    message = _raised(lambda: step(X))
    assert message.startswith("`tf_ops.add_n` was given a JAX value")


def test_other_conversion_errors_are_jaxs_own():
    # No TensorFlow frame: JAX's error, as it was.
    with pytest.raises(jax.errors.TracerArrayConversionError) as info:
        _mirrored().run(lambda x: np.asarray(x), (X,))
    assert not isinstance(info.value, TensorFlowOpError)


def test_a_tensorflow_graph_trace_around_strategy_run_or_a_kd_function_is_refused(monkeypatch):
    # What tf.inside_function() answers while a tf.function traces its body.
    tracing = types.SimpleNamespace(inside_function=lambda: True)
    monkeypatch.setitem(sys.modules, "tensorflow", tracing)
    strategy = _mirrored()
    with pytest.raises(RuntimeError, match=r"^`strategy.run` was called while TensorFlow traces"):
        strategy.run(lambda x: x, (X,))
    with pytest.raises(RuntimeError, match="Decorate the function with `@kd.function` instead of"):
        kd.function(lambda x: x)(X)
    tracing.inside_function = lambda: False  # (eager TensorFlow: nothing to refuse)
    np.testing.assert_array_equal(kd.function(lambda x: x * 2)(X), 2 * X)


# --- With TensorFlow ---------------------------------------------------------------------


def test_tf_ops_in_strategy_run_and_kd_function_with_tensorflow():
    tf = pytest.importorskip("tensorflow")
    strategy = _mirrored()

    def replica_fn(x):
        return tf.add_n([x, x])

    message = _raised(lambda: strategy.run(replica_fn, (X,)))
    assert message.startswith("`tf.add_n` was given a JAX value")
    assert "Use `keras.ops.sum(keras.ops.stack(inputs), axis=0)`" in message

    @kd.function
    def step(x):
        return strategy.run(lambda y: tf.cast(tf.greater(y, 0), tf.float32), (x,))

    message = _raised(lambda: step(X))
    assert message.startswith("`tf.greater` was given a JAX value")
    assert "Use `keras.ops.greater` instead." in message

    @kd.function
    def mean(x):
        return tf.math.reduce_mean(x)

    assert "`tf.math.reduce_mean` was given" in _raised(lambda: mean(X))


def test_a_tf_function_as_replica_function_with_tensorflow():
    tf = pytest.importorskip("tensorflow")

    @tf.function
    def replica_fn(x):
        return x * 2

    message = _raised(lambda: _mirrored().run(replica_fn, (X,)))
    assert message.startswith("A `tf.function` was called with JAX values inside a function")
    assert "Remove `@tf.function` from the replica function" in message


def test_a_tf_function_around_strategy_run_with_tensorflow():
    tf = pytest.importorskip("tensorflow")
    strategy = _mirrored()

    @tf.function
    def train_step(x):  # a tutorial's leftover decorator; x arrives as a symbolic tf.Tensor
        return strategy.run(lambda y: y * 2, (x,))

    @tf.function
    def no_arguments():  # without a tensor argument, TF's graph would keep a constant
        return strategy.run(lambda: 2.0)

    @tf.function
    def calls_a_kd_function(x):
        return kd.function(lambda y: y * 2)(x)

    for call in (lambda: train_step(X), no_arguments, lambda: calls_a_kd_function(X)):
        with pytest.raises(RuntimeError) as info:
            call()
        message = str(info.value)
        assert "was called while TensorFlow traces a `tf.function`" in message
        assert "Decorate the function with `@kd.function` instead of `@tf.function`" in message
    # Outside TF's trace the same function runs.
    result = strategy.run(lambda y: y * 2, (X,))
    np.testing.assert_array_equal(np.asarray(strategy.gather(result, axis=0)), np.tile(2 * X, 2))
