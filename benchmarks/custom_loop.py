"""Throughput of the custom-loop training step under ``strategy.run`` vs. a hand-written jit step.

Both run the example's model (examples/custom_training_loop.py: 64 -> 128 -> 128
-> 10, SGD with momentum) on the same simulated devices, with the same global
batches already on the devices, alternating in one process. The hand-written
step is ``jax.jit(jax.shard_map(...))`` with a ``psum`` of the gradients; like
keras_dist it waits for the previous step before dispatching the next on CPU
(docs/architecture.md: overlapping collective executions abort there).

    python benchmarks/custom_loop.py [--devices 4] [--batch 64] [--steps 200] [--function]

With ``--function`` the whole step (``strategy.run`` and ``strategy.reduce``) is
one ``@kd.function``, as a ported ``@tf.function`` step is: one dispatch a step.
Prints one line: keras_dist steps/s, jit steps/s, and their ratio (median of
the repeats).
"""

import argparse
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

    if args.function:
        step = kd.function(step)

    def run(steps):
        loss = None
        for i in range(steps):
            loss = step(dataset[i % len(dataset)])
        jax.block_until_ready(loss)

    return run, [w.numpy() for w in model.trainable_variables]


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
    baseline = jit_runner(strategy.extended.local_devices, batches, weights)
    ours(20)
    baseline(20)
    ours_rates, baseline_rates, ratios = [], [], []
    for _ in range(args.repeats):
        a = throughput(ours, args.steps)
        b = throughput(baseline, args.steps)
        ours_rates.append(a)
        baseline_rates.append(b)
        ratios.append(a / b)
    print(
        f"custom_loop: keras_dist {'@kd.function' if args.function else 'strategy.run'} "
        f"{statistics.median(ours_rates):.0f} steps/s, "
        f"hand-written jax.jit {statistics.median(baseline_rates):.0f} steps/s, "
        f"ratio {statistics.median(ratios):.2f} (target >= 0.9; "
        f"{strategy.num_replicas_in_sync} x {strategy.extended.local_devices[0].platform}, "
        f"global batch {args.batch}, median of {args.repeats} x {args.steps} steps)"
    )


if __name__ == "__main__":
    main()
