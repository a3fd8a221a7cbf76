"""The hand-written data-parallel training step the benchmarks compare keras_dist against.

A 3-layer ReLU MLP (the layout of the examples' models) with Keras's sparse
categorical cross-entropy and Keras's SGD-with-momentum update, as
``jax.jit(jax.shard_map(...))`` with a ``psum`` of the gradients: what one
would write by hand for data parallelism on a mesh named ``"replica"``.
"""

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec as P


def keras_mlp(features, hidden, classes, learning_rate, momentum):
    """The same MLP as a compiled Keras model (seed 0), for the Keras side of a comparison.

    Build it inside the strategy's scope to distribute it.
    """
    import keras

    keras.utils.set_random_seed(0)
    model = keras.Sequential(
        [
            keras.Input((features,)),
            keras.layers.Dense(hidden, activation="relu"),
            keras.layers.Dense(hidden, activation="relu"),
            keras.layers.Dense(classes),
        ]
    )
    model.compile(
        optimizer=keras.optimizers.SGD(learning_rate, momentum=momentum),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    return model


def mlp_train_step(mesh, global_batch, learning_rate, momentum, steps_per_call=1):
    """``step(params, velocity, x, y) -> (params, velocity, summed_loss)``, compiled, donating.

    With ``steps_per_call=k`` it takes ``k`` stacked batches (``x`` of shape ``(k, batch,
    ...)``) and runs their steps as one ``lax.scan``, returning the last step's loss.
    """

    def loss_fn(params, x, y):
        k1, b1, k2, b2, k3, b3 = params
        h = jax.nn.relu(x @ k1 + b1)
        h = jax.nn.relu(h @ k2 + b2)
        logits = h @ k3 + b3
        # The same math as Keras's sparse categorical cross-entropy (one-hot, no gather).
        per_example = -jnp.sum(jax.nn.one_hot(y, logits.shape[-1]) * jax.nn.log_softmax(logits), -1)
        return jnp.sum(per_example) / global_batch

    def step(params, velocity, x, y):
        loss, grads = jax.value_and_grad(loss_fn)(params, x, y)
        grads = lax.psum(grads, "replica")
        velocity = [momentum * v - learning_rate * g for v, g in zip(velocity, grads)]
        params = [p + v for p, v in zip(params, velocity)]
        return params, velocity, lax.psum(loss, "replica")

    def steps(params, velocity, xs, ys):
        def body(carry, batch):
            params, velocity, loss = step(*carry, *batch)
            return (params, velocity), loss

        (params, velocity), losses = lax.scan(body, (params, velocity), (xs, ys))
        return params, velocity, losses[-1]

    split = P("replica") if steps_per_call == 1 else P(None, "replica")
    return jax.jit(
        jax.shard_map(
            step if steps_per_call == 1 else steps,
            mesh=mesh,
            in_specs=(P(), P(), split, split),
            out_specs=(P(), P(), P()),
            check_vma=False,
        ),
        donate_argnums=(0, 1),
    )


def run_steps(compiled, state, batches, split, serialize):
    """Calls ``compiled`` (``mlp_train_step``'s) on each host ``(x, y)`` of ``batches``,
    put on the devices with ``split``; ``state`` holds ``"params"`` and ``"velocity"``.

    With ``serialize`` (several CPU devices) each call waits for the one before, as
    keras_dist's must there (docs/architecture.md, "A jaxlib hazard").
    """
    loss = None
    for x, y in batches:
        x, y = jax.device_put(x, split), jax.device_put(y, split)
        if loss is not None and serialize:
            loss.block_until_ready()
        state["params"], state["velocity"], loss = compiled(
            state["params"], state["velocity"], x, y
        )
    float(loss)
