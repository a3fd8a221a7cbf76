"""Ctrl-C (a notebook's "interrupt") during training leaves the variables usable.

A step donates the variables' arrays to its program; a ``KeyboardInterrupt``
raised before the new values were stored left every variable deleted ("Array has
been deleted"), and a later read could crash XLA. Each case runs in a process of
its own, which sends itself SIGINT while it trains.
"""

import os
import subprocess
import sys
import textwrap

import pytest

_TRAIN_UNTIL_INTERRUPTED = textwrap.dedent(
    """
    import os, signal, sys, threading
    import numpy as np, keras
    import keras_dist as kd

    strategy = kd.MirroredStrategy(["/cpu:0", "/cpu:1"])
    x = np.random.default_rng(0).normal(size=(64, 4)).astype("float32")
    y = x.sum(axis=1, keepdims=True)
    with strategy.scope():
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
        model.compile(optimizer=keras.optimizers.SGD(0.01, momentum=0.5), loss="mse")
        optimizer = model.optimizer

    @kd.function
    def step(xb, yb):
        def replica(xb, yb):
            def loss_fn():
                return kd.nn.compute_average_loss(keras.ops.mean((model(xb) - yb) ** 2, axis=-1))

            loss, grads = kd.value_and_grad(loss_fn, model.trainable_variables)()
            optimizer.apply_gradients(zip(grads, model.trainable_variables))
            return loss

        return strategy.reduce("SUM", strategy.run(replica, args=(xb, yb)), axis=None)

    completed = 0
    step(x, y)  # compiled before the clock starts
    threading.Timer(1.0, lambda: os.kill(os.getpid(), signal.SIGINT)).start()
    try:
        if sys.argv[1] == "kd.function":
            while True:
                step(x, y)
                completed += 1
        else:
            model.fit(x, y, batch_size=8, epochs=100000, verbose=0)
    except KeyboardInterrupt:
        pass
    iterations = int(optimizer.iterations.numpy())
    weights = model.get_weights()
    assert all(np.isfinite(w).all() for w in weights)
    if sys.argv[1] == "kd.function":
        # The step the interrupt met finished and was stored, or never started.
        assert iterations - 1 in (completed, completed + 1), (iterations, completed)
    step(x, y)  # training goes on
    assert int(optimizer.iterations.numpy()) == iterations + 1
    print("went on from", iterations, flush=True)
    """
)


@pytest.mark.parametrize("loop", ["kd.function", "fit"])
def test_an_interrupted_loop_leaves_the_variables_at_the_last_step(loop, tmp_path):
    script = tmp_path / "interrupted.py"
    script.write_text(_TRAIN_UNTIL_INTERRUPTED)
    env = dict(
        os.environ,
        KERAS_BACKEND="jax",
        XLA_FLAGS="--xla_force_host_platform_device_count=2",
        JAX_PLATFORMS="cpu",
    )
    done = subprocess.run(
        [sys.executable, str(script), loop], env=env, capture_output=True, text=True, timeout=180
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "went on from" in done.stdout
