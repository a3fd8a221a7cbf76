"""``model.fit`` throughput under keras_dist strategies against two baselines.

In one invocation, on the same devices and the same data:

(a) ``MirroredStrategy`` fit on N simulated devices against a hand-written
    ``jax.jit(jax.shard_map(...))`` data-parallel loop of the same model and
    optimizer (SGD with momentum, Keras's update rule), fed the same NumPy
    batches. Like keras_dist, the loop waits for each step before dispatching
    the next on CPU (docs/architecture.md, "A jaxlib hazard").
(b) ``OneDeviceStrategy`` fit against plain Keras ``fit`` on one device.

    python benchmarks/fit.py [--devices 4] [--batch 256] [--steps 100]
                             [--steps-per-execution 1]

Prints one line with both ratios (medians of the repeats). With
``--steps-per-execution N`` both keras_dist fits compile with Keras's
``steps_per_execution=N`` (N steps run as one compiled call); the baselines
stay one step per call.
"""

import argparse
import os
import statistics

from _platform import simulate_cpu_devices
from _timing import steps_per_second

parser = argparse.ArgumentParser(description=__doc__)
parser.add_argument("--devices", type=int, default=4)
parser.add_argument("--batch", type=int, default=256, help="global batch size")
parser.add_argument("--steps", type=int, default=100, help="steps per epoch")
parser.add_argument("--repeats", type=int, default=5)
parser.add_argument(
    "--steps-per-execution", type=int, default=1, help="Keras's steps_per_execution of our fits"
)
args = parser.parse_args()
simulate_cpu_devices(args.devices)
os.environ.setdefault("KERAS_BACKEND", "jax")

import jax  # noqa: E402
import numpy as np  # noqa: E402
from _jit_baseline import keras_mlp  # noqa: E402
from _jit_baseline import mlp_train_step  # noqa: E402
from _jit_baseline import run_steps  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import keras_dist as kd  # noqa: E402

FEATURES, HIDDEN, CLASSES = 128, 512, 10
LEARNING_RATE, MOMENTUM = 0.01, 0.9


def build_model(steps_per_execution=1):
    model = keras_mlp(FEATURES, HIDDEN, CLASSES, LEARNING_RATE, MOMENTUM)
    if steps_per_execution != 1:
        model.compile(model.optimizer, model.loss, steps_per_execution=steps_per_execution)
    return model


def keras_fit(strategy, x, y):
    """A fit() runner: the model under ``strategy`` (None: plain Keras)."""
    if strategy is None:
        model = build_model()
    else:
        with strategy.scope():
            model = build_model(args.steps_per_execution)

    def run():
        model.fit(x, y, batch_size=args.batch, epochs=1, shuffle=False, verbose=0)

    return run, model


def jit_loop(devices, x, y, initial_weights):
    mesh = jax.sharding.Mesh(np.array(devices), ("replica",))
    replicated, split = NamedSharding(mesh, P()), NamedSharding(mesh, P("replica"))
    state = {
        "params": [jax.device_put(w, replicated) for w in initial_weights],
        "velocity": [jax.device_put(np.zeros_like(w), replicated) for w in initial_weights],
    }
    batch = args.batch
    compiled = mlp_train_step(mesh, batch, LEARNING_RATE, MOMENTUM)
    serialize = len(devices) > 1 and devices[0].platform == "cpu"

    def run():
        batches = ((x[i : i + batch], y[i : i + batch]) for i in range(0, len(x), batch))
        run_steps(compiled, state, batches, split, serialize)

    return run


def main():
    rng = np.random.default_rng(0)
    rows = args.batch * args.steps
    x = rng.normal(size=(rows, FEATURES)).astype("float32")
    y = rng.integers(0, CLASSES, rows).astype("int32")

    mirrored = kd.MirroredStrategy()
    ours, model = keras_fit(mirrored, x, y)
    weights = [w.numpy() for w in model.trainable_variables]
    baseline = jit_loop(mirrored.extended.local_devices, x, y, weights)
    one_device, _ = keras_fit(kd.OneDeviceStrategy(jax.devices()[0]), x, y)
    plain, _ = keras_fit(None, x, y)
    for run in (ours, baseline, one_device, plain):
        run()  # compile

    ratios_a, ratios_b, rates = [], [], {k: [] for k in ("ours", "jit", "one", "plain")}
    for _ in range(args.repeats):
        a, b = steps_per_second(ours, args.steps), steps_per_second(baseline, args.steps)
        c, d = steps_per_second(one_device, args.steps), steps_per_second(plain, args.steps)
        ratios_a.append(a / b)
        ratios_b.append(c / d)
        for key, value in zip(rates, (a, b, c, d)):
            rates[key].append(value)
    med = {k: statistics.median(v) for k, v in rates.items()}
    print(
        f"fit: MirroredStrategy {med['ours']:.0f} steps/s vs hand-written jax.jit loop "
        f"{med['jit']:.0f} steps/s, ratio {statistics.median(ratios_a):.2f} (target >= 1.2); "
        f"OneDeviceStrategy {med['one']:.0f} steps/s vs plain Keras fit {med['plain']:.0f} "
        f"steps/s, ratio {statistics.median(ratios_b):.2f} (target >= 1.0) "
        f"[{mirrored.num_replicas_in_sync} x {jax.devices()[0].platform}, global batch "
        f"{args.batch}, {args.steps} steps/epoch, median of {args.repeats}"
        + (
            f", keras_dist with steps_per_execution={args.steps_per_execution}]"
            if args.steps_per_execution != 1
            else "]"
        )
    )


if __name__ == "__main__":
    main()
