"""``model.predict`` throughput under keras_dist strategies against two baselines.

In one invocation, on the same devices and the same data:

(a) ``MirroredStrategy`` predict on N devices (simulated CPUs, or the
    accelerators) against a hand-written ``jax.jit(jax.shard_map(...))`` forward
    pass of the same MLP: each batch put on the devices split between them, and
    its outputs read back to NumPy, as Keras's predict loop reads them;
(b) ``OneDeviceStrategy`` predict against plain Keras ``predict`` on one device.

    python benchmarks/predict.py [--devices 4] [--batch 256] [--batches 100]
    python benchmarks/predict.py --features 8 --hidden 8 --batch 16   # host-bound
    python benchmarks/predict.py --trained   # after a fit step: the optimizer's slots exist

Prints one line with both ratios (medians of the rounds' ratios; the four runs
of a round alternate).
"""

import argparse
import os
import statistics
import time

from _platform import simulate_cpu_devices

parser = argparse.ArgumentParser(description=__doc__)
parser.add_argument("--devices", type=int, default=4)
parser.add_argument("--batch", type=int, default=256, help="global batch size")
parser.add_argument("--batches", type=int, default=100, help="batches per predict")
parser.add_argument("--features", type=int, default=128)
parser.add_argument("--hidden", type=int, default=512)
parser.add_argument("--repeats", type=int, default=7)
parser.add_argument(
    "--trained", action="store_true", help="fit one batch first, as predict usually follows fit"
)
args = parser.parse_args()
simulate_cpu_devices(args.devices)
os.environ.setdefault("KERAS_BACKEND", "jax")

import jax  # noqa: E402
import numpy as np  # noqa: E402
from _jit_baseline import keras_mlp  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import keras_dist as kd  # noqa: E402

CLASSES = 10


def keras_predict(strategy, x):
    """A predict() runner for the MLP under ``strategy`` (None: plain Keras)."""
    if strategy is None:
        model = keras_mlp(args.features, args.hidden, CLASSES, 0.01, 0.9)
    else:
        with strategy.scope():
            model = keras_mlp(args.features, args.hidden, CLASSES, 0.01, 0.9)
    if args.trained:
        labels = np.zeros(args.batch, "int32")
        model.fit(x[: args.batch], labels, batch_size=args.batch, epochs=1, verbose=0)

    def run():
        return model.predict(x, batch_size=args.batch, verbose=0)

    return run, model


def jit_forward(devices, x, weights):
    """The hand-written data-parallel forward pass over ``devices``, batch by batch."""
    mesh = jax.sharding.Mesh(np.array(devices), ("replica",))
    replicated, split = NamedSharding(mesh, P()), NamedSharding(mesh, P("replica"))
    params = [jax.device_put(w, replicated) for w in weights]

    def forward(params, x):
        k1, b1, k2, b2, k3, b3 = params
        h = jax.nn.relu(x @ k1 + b1)
        h = jax.nn.relu(h @ k2 + b2)
        return h @ k3 + b3

    compiled = jax.jit(
        jax.shard_map(forward, mesh=mesh, in_specs=(P(), P("replica")), out_specs=P("replica"))
    )

    def run():
        outputs = []
        for start in range(0, len(x), args.batch):
            rows = jax.device_put(x[start : start + args.batch], split)
            outputs.append(np.asarray(compiled(params, rows)))
        return np.concatenate(outputs)

    return run


def seconds(run):
    start = time.perf_counter()
    run()
    return time.perf_counter() - start


def main():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(args.batch * args.batches, args.features)).astype("float32")

    mirrored = kd.MirroredStrategy()
    ours, model = keras_predict(mirrored, x)
    weights = [w.numpy() for w in model.trainable_variables]
    baseline = jit_forward(mirrored.extended.local_devices, x, weights)
    one_device, _ = keras_predict(kd.OneDeviceStrategy(jax.devices()[0]), x)
    plain, _ = keras_predict(None, x)
    # The same numbers first: the comparison is of equal work (loose: TF32 on GPUs).
    np.testing.assert_allclose(ours(), baseline(), rtol=1e-3, atol=1e-3)
    np.testing.assert_allclose(one_device(), plain(), rtol=1e-3, atol=1e-3)

    times = {key: [] for key in ("ours", "jit", "one", "plain")}
    for _ in range(args.repeats):
        for key, run in zip(times, (ours, baseline, one_device, plain)):
            times[key].append(seconds(run))
    ratio_a = statistics.median(j / o for o, j in zip(times["ours"], times["jit"]))
    ratio_b = statistics.median(p / o for o, p in zip(times["one"], times["plain"]))
    rate = {key: args.batches / statistics.median(t) for key, t in times.items()}
    print(
        f"predict: MirroredStrategy {rate['ours']:.0f} batches/s vs hand-written jax.jit "
        f"forward {rate['jit']:.0f} batches/s, ratio {ratio_a:.2f}; OneDeviceStrategy "
        f"{rate['one']:.0f} batches/s vs plain Keras predict {rate['plain']:.0f} batches/s, "
        f"ratio {ratio_b:.2f} [{mirrored.num_replicas_in_sync} x {jax.devices()[0].platform}, "
        f"MLP {args.features}-{args.hidden}-{args.hidden}-{CLASSES}, global batch {args.batch}, "
        f"{args.batches} batches, {'after a fit step, ' if args.trained else ''}"
        f"median of {args.repeats}]"
    )


if __name__ == "__main__":
    main()
