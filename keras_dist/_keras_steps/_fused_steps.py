"""Several of ``fit``'s steps in one compiled call (Keras's ``steps_per_execution``).

A step here is Keras's stateless one, ``step(state, data) -> (state, logs)``,
and the state is threaded from step to step inside the program, which runs
the steps as one ``lax.scan`` over the stacked batches: one copy of the step,
as TF's ``while`` loop, so the program compiles in about one step's time
whatever ``steps_per_execution`` is. (Unrolled, 50 steps compiled 50 copies:
7.5x the loop's first call for an MLP on 2 CPU devices.)

On CPU a model with convolutions runs its steps one call each instead: XLA:CPU
runs a convolution's gradient inside a loop about 10x slower than outside one
(``benchmarks/steps_per_execution.py --model cnn``), and one call a step is as
fast as 50 unrolled steps there.

>>> import jax.numpy as jnp
>>> step = lambda state, x: (state + x, {"total": state + x})
>>> logs, state = fused_steps(step, jnp.float32(0), [jnp.float32(1), jnp.float32(2)])
>>> float(state), float(logs["total"])
(3.0, 3.0)
"""

import functools

import jax
import jax.numpy as jnp
import keras
from jax.extend import core as jax_core

from keras_dist._keras import model_layers


class MultiStep:
    """A replica function running several batches' steps (``replica_steps(datas, rows)``).

    ``rows`` are the batches' global row counts (a train step scales its loss by them).
    A method of an object of its own: its traces are counted per model (fitting
    one model after another traces each one's steps once, which is not retracing).
    """

    def __init__(self, replica_steps):
        self._replica_steps = replica_steps

    def steps(self, datas, rows):
        return self._replica_steps(datas, rows)


def steps_fuse(devices, model, data) -> bool:
    """Whether an execution's batches of one layout run as one program (``fused_steps``)
    on ``devices``: everywhere but for a model with convolutions on CPU.

    ``data`` is one of the batches. The convolutions are looked for in the model's
    forward program on it, so a layer calling ``ops.conv`` itself counts whatever its
    name; a model that program cannot be traced for is judged by its layers' classes.
    """
    if devices[0].platform != "cpu":
        return True
    convolves = _forward_convolves(model, data)
    if convolves is None:
        convolves = any(
            "Conv" in cls.__name__ for layer in model_layers(model) for cls in type(layer).__mro__
        )
    return not convolves


def _forward_convolves(model, data):
    """Whether ``model``'s forward program on ``data``'s inputs holds a convolution
    (``None``: it could not be traced, e.g. a custom ``train_step`` reading ``data``
    in its own way)."""
    inputs, _, _ = keras.utils.unpack_x_y_sample_weight(data)
    forward = functools.partial(model.stateless_call, training=False)
    try:
        program = jax.make_jaxpr(forward)(
            [v.value for v in model.trainable_variables],
            [v.value for v in model.non_trainable_variables],
            inputs,
        )
    except Exception:  # noqa: BLE001 - only which form runs depends on it, not the numbers
        return None
    return _holds(program.jaxpr, "conv_general_dilated")


def _holds(jaxpr, primitive: str) -> bool:
    """Whether ``jaxpr`` or one nested in it (a ``jit``, ``scan`` or ``cond`` body) calls
    ``primitive``."""
    return any(eqn.primitive.name == primitive for eqn in jaxpr.eqns) or any(
        _holds(inner, primitive) for inner in jax_core.subjaxprs(jaxpr)
    )


def fused_steps(step, state, datas):
    """``(last logs, final state)`` of ``step`` over ``datas`` in turn, one ``lax.scan``.

    The batches must have one layout (one shape each), as fused batches do.
    """
    if len(datas) == 1:
        state, logs = step(state, datas[0])
        return logs, state
    state = jax.tree_util.tree_map(_strongly_typed, _as_lists(state))

    def body(carry, data):
        new_state, logs = step(carry, data)
        # The carry keeps its types (a step may hand back a weakly typed scalar).
        new_state = jax.tree_util.tree_map(
            lambda new, old: jax.lax.convert_element_type(new, old.dtype),
            _as_lists(new_state),
            carry,
        )
        return new_state, logs

    stacked = jax.tree_util.tree_map(lambda *xs: jnp.stack(xs), *datas)
    state, logs = jax.lax.scan(body, state, stacked)
    return jax.tree_util.tree_map(lambda x: x[-1], logs), state


def _as_lists(state):
    """Keras's state tuple with lists inside, whichever sequences the step gave back."""
    if isinstance(state, (tuple, list)):
        return tuple(list(group) if isinstance(group, (tuple, list)) else group for group in state)
    return state


def _strongly_typed(x):
    return jax.lax.convert_element_type(x, jnp.result_type(x))
