"""`value_and_grad`: gradients of a loss with respect to Keras variables.

JAX has no tape. ``keras_dist.value_and_grad(loss_fn, variables)`` returns a
function computing ``loss_fn(*args)`` and its gradients with respect to
``variables``; assignments ``loss_fn`` makes to other variables (batch-norm
statistics, say) are kept. Inside ``strategy.run`` gradients are per replica,
as TF's tape gives them; the optimizer sums them across replicas.

A variable the loss does not depend on gets ``None``, as ``tape.gradient``
gives it (JAX's zeros would let the optimizer's weight decay shrink a variable
TF leaves alone; Keras's optimizer skips ``None``, with a warning), and so does
a variable that is not floating-point (an integer seed state in
``model.variables``). A loss of several values is differentiated as their sum,
as the tape does; the loss itself is returned as it is.
"""

import jax
from jax.custom_derivatives import SymbolicZero

from keras_dist._keras import RecordingScope
from keras_dist._keras import current_scope
from keras_dist._keras import variable_has_value


def value_and_grad(loss_fn, variables, has_aux: bool = False):
    """Returns ``f(*args, **kwargs) -> (loss, grads)`` for ``loss_fn`` and ``variables``.

    With ``has_aux=True``, ``loss_fn`` returns ``(loss, aux)`` and ``f`` returns
    ``((loss, aux), grads)``. Callable in any context.

    >>> import keras, keras_dist as kd
    >>> w = keras.Variable(3.0)
    >>> loss, grads = kd.value_and_grad(lambda: w * w, [w])()
    >>> float(loss), float(grads[0])
    (9.0, 6.0)

    A variable the loss does not use gets ``None``, as from TF's tape:

    >>> unused = keras.Variable(1.0)
    >>> kd.value_and_grad(lambda: w * w, [w, unused])()[1][1] is None
    True
    """
    variables = list(variables)

    def wrapped(*args, **kwargs):
        _check_built(variables)
        enclosing = current_scope()  # a trace's: what the loss reads besides ``variables``
        outer = dict(enclosing.state_mapping) if enclosing is not None else {}
        current = [v.value for v in variables]
        # Only floating-point variables have gradients; the others (an integer seed
        # state, a step counter) get ``None``, as from TF's tape, and are read as they are.
        differentiable = [_is_differentiable(x) for x in current]
        watched = [x for x, d in zip(current, differentiable) if d]
        fixed = {id(v): x for v, x, d in zip(variables, current, differentiable) if not d}
        writes = []  # (variable, kind), replayed after the gradient

        reached = [False] * len(watched)  # set while the gradient is traced

        def pure(values):
            values = iter(_watched(reached)(values))
            mapping = dict(outer)
            mapping.update(fixed)
            mapping.update({id(v): next(values) for v, d in zip(variables, differentiable) if d})
            deferred = []
            with RecordingScope(mapping, deferred_writes=deferred, parent=enclosing) as scope:
                out = loss_fn(*args, **kwargs)
            # Distributed variables replay each write with its aggregation;
            # plain ones take their final value.
            deferred_ids = {id(v) for v, _, _ in deferred}
            writes[:] = [(v, kind) for v, kind, _ in deferred]
            values_out = [value for _, _, value in deferred]
            for variable in scope.assigned.values():
                if id(variable) not in deferred_ids:
                    writes.append((variable, "assign"))
                    values_out.append(scope.state_mapping[id(variable)])
            loss, aux = out if has_aux else (out, None)
            # A loss of several values is differentiated as their sum, as by the tape.
            return jax.numpy.sum(loss), (loss, aux, values_out)

        (_, (loss, aux, values_out)), grads = jax.value_and_grad(pure, has_aux=True)(watched)
        for (variable, kind), value in zip(writes, values_out):
            getattr(variable, kind)(value)
        grads = iter([g if connected else None for g, connected in zip(grads, reached)])
        grads = [next(grads) if d else None for d in differentiable]
        return ((loss, aux) if has_aux else loss), grads

    return wrapped


def _is_differentiable(value) -> bool:
    return jax.numpy.issubdtype(jax.numpy.result_type(value), jax.numpy.inexact)


def _watched(reached):
    """The identity on a list of values, noting in ``reached[i]`` whether a gradient
    flows back to the i-th.

    JAX hands the backward rule a symbolic zero for an output the loss never uses
    (or uses through ``stop_gradient``): that variable is unconnected, as TF's tape
    says with ``None``. A gradient that is zero by arithmetic (a dead ReLU,
    ``0 * w``) is an array of zeros, and stays one, as in TF.
    """

    @jax.custom_vjp
    def watch(values):
        return values

    def forward(values):
        return [v.value for v in values], None

    def backward(_, cotangents):
        through = []
        for i, cotangent in enumerate(cotangents):
            unconnected = isinstance(cotangent, SymbolicZero)
            reached[i] = reached[i] or not unconnected
            through.append(None if unconnected else cotangent)
        return (through,)

    watch.defvjp(forward, backward, symbolic_zeros=True)
    return watch


def _check_built(variables) -> None:
    """JAX has no tape to find variables later: they must exist when the gradient is taken."""
    missing = [v for v in variables if not variable_has_value(v)]
    if variables and not missing:
        return
    received = "variables=[]" if not variables else f"unbuilt variables={[v.path for v in missing]}"
    raise ValueError(
        "`value_and_grad` needs the variables to differentiate, built: Keras creates a "
        "layer's weights on its first call, so `model.trainable_variables` is empty "
        "until then. Build the model first, inside `strategy.scope()` (e.g. "
        "`keras.Input` in a Sequential model, `model.build(input_shape)`, or one call on "
        f"a batch), then take `model.trainable_variables`. Received: {received}"
    )
