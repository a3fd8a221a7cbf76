"""Throughput of the custom-loop training step under ``strategy.run`` vs. a hand-written jit step.

Both run the example's model (examples/custom_training_loop.py: 64 -> 128 -> 128
-> 10, SGD with momentum) on the same simulated devices, with the same global
batches already on the devices, alternating in one process. The hand-written
step is ``jax.jit(jax.shard_map(...))`` with a ``psum`` of the gradients; like
keras_dist it waits for the previous step before dispatching the next on CPU
(docs/architecture.md: overlapping collective executions abort there).

A second baseline is Keras's own JAX loop (its guide's: ``stateless_call`` and
``optimizer.stateless_apply`` in one ``jax.jit``, the batch split over the same
devices): the same Keras layers, loss and optimizer ops as keras_dist runs, so
its ratio is keras_dist's own cost. On a GPU, where a small step is as long as
its kernels, the hand-written step's fewer, fused kernels are faster than
Keras's, with or without a strategy.

    python benchmarks/custom_loop.py [--devices 4] [--batch 64] [--steps 200] [--function]

With ``--function`` the whole step (``strategy.run`` and ``strategy.reduce``) is
one ``@kd.function``, as a ported ``@tf.function`` step is: one dispatch a step.
Prints one line: keras_dist steps/s, each baseline's steps/s, and the ratios
(median of the repeats).
"""

import argparse
import itertools
import os
import statistics
import sys
import time

from _platform import simulate_cpu_devices

parser = argparse.ArgumentParser(description=__doc__)
parser.add_argument("--devices", type=int, default=4)
parser.add_argument("--batch", type=int, default=64, help="global batch size")
parser.add_argument("--steps", type=int, default=200, help="steps per timed repeat")
parser.add_argument("--repeats", type=int, default=7)
parser.add_argument("--function", action="store_true", help="the step as one @kd.function")
parser.add_argument(
    "--steps-per-call",
    type=int,
    default=1,
    help="with --function: steps a call runs, each on next(iterator) (TF's multi-step loop)",
)
args = parser.parse_args()
simulate_cpu_devices(args.devices)
os.environ.setdefault("KERAS_BACKEND", "jax")
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "examples"))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import keras  # noqa: E402
import numpy as np  # noqa: E402
from _jit_baseline import mlp_train_step  # noqa: E402
from custom_training_loop import build_model  # noqa: E402
from custom_training_loop import make_train_step  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import keras_dist as kd  # noqa: E402

LEARNING_RATE, MOMENTUM = 0.05, 0.9


def keras_dist_runner(strategy, batches):
    with strategy.scope():
        model = build_model()
        optimizer = keras.optimizers.SGD(LEARNING_RATE, momentum=MOMENTUM)
    train_step = make_train_step(model, optimizer, global_batch_size=args.batch)

    dataset = list(strategy.experimental_distribute_dataset(batches))

    def step(batch):
        return strategy.reduce("SUM", strategy.run(train_step, args=(batch,)), None)

    if args.steps_per_call > 1:
        return multi_step_runner(strategy, step, batches), weights_of(model)
    if args.function:
        step = kd.function(step)

    def run(steps):
        loss = None
        for i in range(steps):
            loss = step(dataset[i % len(dataset)])
        jax.block_until_ready(loss)

    return run, weights_of(model)


def weights_of(model):
    return [w.numpy() for w in model.trainable_variables]


class _Forever:
    """The batches over and over (a re-iterable, as ``experimental_distribute_dataset`` takes)."""

    def __init__(self, batches):
        self._batches = batches

    def __iter__(self):
        return itertools.cycle(self._batches)


def multi_step_runner(strategy, step, batches):
    """TF's multi-step loop: ``--steps-per-call`` steps in one ``@kd.function`` call, each
    on ``next(iterator)`` (one dispatch for them all)."""
    iterator = iter(strategy.experimental_distribute_dataset(_Forever(batches)))
    per_call = args.steps_per_call

    @kd.function
    def steps_of(iterator):
        for _ in range(per_call):
            loss = step(next(iterator))
        return loss

    def run(steps):
        loss = None
        for _ in range(max(1, steps // per_call)):
            loss = steps_of(iterator)
        jax.block_until_ready(loss)

    return run


def jit_runner(devices, batches, initial_weights):
    mesh = jax.sharding.Mesh(np.array(devices), ("replica",))
    replicated, split = NamedSharding(mesh, P()), NamedSharding(mesh, P("replica"))
    params = [jax.device_put(w, replicated) for w in initial_weights]
    momentum = [jax.device_put(jnp.zeros_like(w), replicated) for w in initial_weights]
    data = [(jax.device_put(x, split), jax.device_put(y, split)) for x, y in batches]
    global_batch = args.batch

    compiled = mlp_train_step(mesh, global_batch, LEARNING_RATE, MOMENTUM)
    state = {"params": params, "momentum": momentum}
    serialize = len(devices) > 1 and devices[0].platform == "cpu"

    def run(steps):
        loss = None
        for i in range(steps):
            if loss is not None and serialize:
                loss.block_until_ready()  # one collective execution in flight on CPU
            x, y = data[i % len(data)]
            state["params"], state["momentum"], loss = compiled(
                state["params"], state["momentum"], x, y
            )
        jax.block_until_ready(loss)

    return run


def keras_jit_runner(devices, batches, initial_weights):
    """Keras's guide loop: the model's stateless step in one ``jax.jit``, batch split by GSPMD."""
    model = build_model()
    optimizer = keras.optimizers.SGD(LEARNING_RATE, momentum=MOMENTUM)
    optimizer.build(model.trainable_variables)
    for variable, weight in zip(model.trainable_variables, initial_weights):
        variable.assign(weight)
    loss_object = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction=None)
    global_batch = args.batch

    def loss_fn(trainable, non_trainable, x, y):
        logits, non_trainable = model.stateless_call(trainable, non_trainable, x, training=True)
        return jnp.sum(loss_object(y, logits)) / global_batch, non_trainable

    gradient = jax.value_and_grad(loss_fn, has_aux=True)

    def step(state, x, y):
        trainable, non_trainable, slots = state
        (loss, non_trainable), grads = gradient(trainable, non_trainable, x, y)
        trainable, slots = optimizer.stateless_apply(slots, grads, trainable)
        return (trainable, non_trainable, slots), loss

    mesh = jax.sharding.Mesh(np.array(devices), ("replica",))
    replicated, split = NamedSharding(mesh, P()), NamedSharding(mesh, P("replica"))
    compiled = jax.jit(
        step,
        donate_argnums=0,
        in_shardings=(replicated, split, split),
        out_shardings=(replicated, replicated),
    )
    state = {
        "state": jax.device_put(
            (
                [v.value for v in model.trainable_variables],
                [v.value for v in model.non_trainable_variables],
                [v.value for v in optimizer.variables],
            ),
            replicated,
        )
    }
    data = [(jax.device_put(x, split), jax.device_put(y, split)) for x, y in batches]
    serialize = len(devices) > 1 and devices[0].platform == "cpu"

    def run(steps):
        loss = None
        for i in range(steps):
            if loss is not None and serialize:
                loss.block_until_ready()
            x, y = data[i % len(data)]
            state["state"], loss = compiled(state["state"], x, y)
        jax.block_until_ready(loss)

    return run


def throughput(run, steps):
    start = time.perf_counter()
    run(steps)
    return steps / (time.perf_counter() - start)


def main():
    keras.utils.set_random_seed(0)
    rng = np.random.default_rng(0)
    batches = [
        (
            rng.random((args.batch, 64), dtype=np.float32),
            rng.integers(0, 10, args.batch).astype("int32"),
        )
        for _ in range(8)
    ]
    strategy = kd.MirroredStrategy()
    ours, weights = keras_dist_runner(strategy, batches)
    devices = strategy.extended.local_devices
    runners = {
        "ours": ours,
        "jit": jit_runner(devices, batches, weights),
        "keras": keras_jit_runner(devices, batches, weights),
    }
    for run in runners.values():
        run(20)
    rates = {name: [] for name in runners}
    for _ in range(args.repeats):
        for name, run in runners.items():
            rates[name].append(throughput(run, args.steps))

    def ratio(baseline):
        return statistics.median(a / b for a, b in zip(rates["ours"], rates[baseline]))

    median = {name: statistics.median(values) for name, values in rates.items()}
    mode = "@kd.function" if args.function else "strategy.run"
    if args.steps_per_call > 1:
        mode = f"@kd.function of {args.steps_per_call} steps on next(iterator)"
    print(
        f"custom_loop: keras_dist {mode} "
        f"{median['ours']:.0f} steps/s, hand-written jax.jit {median['jit']:.0f} steps/s, "
        f"ratio {ratio('jit'):.2f} (target >= 0.9); Keras's own jit step "
        f"{median['keras']:.0f} steps/s, ratio {ratio('keras'):.2f} "
        f"({strategy.num_replicas_in_sync} x {devices[0].platform}, "
        f"global batch {args.batch}, median of {args.repeats} x {args.steps} steps)"
    )


if __name__ == "__main__":
    main()
