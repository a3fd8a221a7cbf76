"""How keras_dist's cost grows with replicas and model size, against one device.

For each model size (an MLP of about 0.1 M to 50 M parameters) and each replica
count (1, 2, 4, 8 devices of this machine), in one invocation:

* ``fit``: ``MirroredStrategy`` over the devices, the same global batch;
* the custom loop: a ``kd.function`` step around ``strategy.run`` (TF's loop);

each against plain Keras ``fit`` of the same model on one device, the baseline.
A table row gives steps/s, the ratio to the baseline, and the per-step time the
distribution adds (µs; negative when the replicas are faster than one device).
On this CPU machine the simulated devices share 2 cores, so more replicas cannot
be faster: the table shows what the machinery costs, not a speed-up. On a GPU
machine the same script spreads the work over the GPUs.

    python benchmarks/scaling.py [--replicas 1,2,4,8] [--params 0.1,1,10,50]
        [--batch 256] [--steps 10] [--plot docs/guides/img/scaling.png]

Prints the table (Markdown), then one summary line; ``--plot`` also writes a
PNG (needs matplotlib).
"""

import argparse
import os
import statistics
import time

from _platform import simulate_cpu_devices

parser = argparse.ArgumentParser(description=__doc__)
parser.add_argument("--replicas", default="1,2,4,8")
parser.add_argument("--params", default="0.1,1,10,50", help="model sizes, millions")
parser.add_argument("--batch", type=int, default=256, help="global batch size")
parser.add_argument("--steps", type=int, default=10, help="timed steps per measurement")
parser.add_argument("--repeats", type=int, default=3)
parser.add_argument("--plot", default=None, help="write a PNG of the ratios here")
args = parser.parse_args()
REPLICAS = [int(r) for r in args.replicas.split(",")]
SIZES = [float(p) for p in args.params.split(",")]
# Simulated CPU devices for a machine without accelerators (the flag only touches
# the host platform: on a GPU machine jax.devices() are the GPUs).
simulate_cpu_devices(max(REPLICAS))
os.environ.setdefault("KERAS_BACKEND", "jax")

import jax  # noqa: E402
import numpy as np  # noqa: E402
from _jit_baseline import keras_mlp  # noqa: E402

import keras_dist as kd  # noqa: E402

FEATURES, CLASSES = 256, 10


def hidden_for(millions: float) -> int:
    """The width of a 2-hidden-layer MLP with about ``millions`` parameters."""
    # params ~ F*h + h*h + h*C: solve h^2 + (F + C) h - P = 0.
    target = millions * 1e6
    return max(
        8, int((-(FEATURES + CLASSES) + ((FEATURES + CLASSES) ** 2 + 4 * target) ** 0.5) / 2)
    )


def build(hidden):
    return keras_mlp(FEATURES, hidden, CLASSES, learning_rate=0.01, momentum=0.9)


def fit_runner(strategy, hidden, x, y):
    if strategy is None:
        model = build(hidden)
    else:
        with strategy.scope():
            model = build(hidden)

    def run():
        model.fit(x, y, batch_size=args.batch, epochs=1, shuffle=False, verbose=0)

    return run, sum(int(np.prod(w.shape)) for w in model.trainable_variables)


def loop_runner(strategy, hidden, x, y):
    import keras

    with strategy.scope():
        model = build(hidden)
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction=None)

    @kd.function
    def step(batch):
        def replica_step(inputs, targets):
            def loss():
                return kd.nn.compute_average_loss(
                    loss_fn(targets, model(inputs, training=True)),
                    global_batch_size=args.batch,
                )

            value, grads = kd.value_and_grad(loss, model.trainable_variables)()
            model.optimizer.apply_gradients(zip(grads, model.trainable_variables))
            return value

        return strategy.reduce("SUM", strategy.run(replica_step, args=batch), axis=None)

    batches = [(x[i : i + args.batch], y[i : i + args.batch]) for i in range(0, len(x), args.batch)]
    dataset = strategy.experimental_distribute_dataset(batches)

    def run():
        loss = None
        for batch in dataset:
            loss = step(batch)
        float(loss)

    return run


def steps_per_second(run) -> float:
    run()  # compile, and warm up
    rates = []
    for _ in range(args.repeats):
        start = time.perf_counter()
        run()
        rates.append(args.steps / (time.perf_counter() - start))
    return statistics.median(rates)


def main():
    devices = jax.devices()
    platform = devices[0].platform
    rng = np.random.default_rng(0)
    rows = args.batch * args.steps
    x = rng.normal(size=(rows, FEATURES)).astype("float32")
    y = rng.integers(0, CLASSES, rows).astype("int32")
    table = []
    for millions in SIZES:
        hidden = hidden_for(millions)
        run, params = fit_runner(None, hidden, x, y)
        one = steps_per_second(run)
        for replicas in REPLICAS:
            if replicas > len(devices):
                continue
            strategy = kd.MirroredStrategy(devices[:replicas])
            fit_rate = steps_per_second(fit_runner(strategy, hidden, x, y)[0])
            loop_rate = steps_per_second(loop_runner(strategy, hidden, x, y))
            table.append((params, replicas, one, fit_rate, loop_rate))
            print(f"  measured {params / 1e6:.2f} M params on {replicas} replicas", flush=True)
    print()
    print(
        "| params | replicas | one device steps/s | fit steps/s | fit ratio | fit overhead "
        "µs/step | custom loop steps/s | loop ratio | loop overhead µs/step |"
    )
    print("| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for params, replicas, one, fit_rate, loop_rate in table:
        print(
            f"| {params / 1e6:.2f} M | {replicas} | {one:.1f} | {fit_rate:.1f} | "
            f"{fit_rate / one:.2f} | {(1 / fit_rate - 1 / one) * 1e6:.0f} | {loop_rate:.1f} | "
            f"{loop_rate / one:.2f} | {(1 / loop_rate - 1 / one) * 1e6:.0f} |"
        )
    if args.plot:
        plot(table, args.plot, platform)
    ratios = [fit_rate / one for _, _, one, fit_rate, _ in table]
    print(
        f"scaling: fit / one-device ratio from {min(ratios):.2f} to {max(ratios):.2f} over "
        f"{len(SIZES)} model sizes x replicas {REPLICAS} [{platform}, {len(devices)} devices, "
        f"global batch {args.batch}, median of {args.repeats}]"
    )


def plot(table, path, platform):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(1, 2, figsize=(10, 4), sharey=True)
    for axis, column, title in ((axes[0], 3, "fit"), (axes[1], 4, "custom loop")):
        for params in sorted({row[0] for row in table}):
            rows = [row for row in table if row[0] == params]
            axis.plot(
                [row[1] for row in rows],
                [row[column] / row[2] for row in rows],
                marker="o",
                label=f"{params / 1e6:.1f} M params",
            )
        axis.set_xscale("log", base=2)
        axis.set_xlabel("replicas")
        axis.set_title(f"{title} ({platform})")
        axis.axhline(1.0, color="gray", linewidth=0.5)
    axes[0].set_ylabel("steps/s relative to one device")
    axes[1].legend()
    figure.tight_layout()
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    figure.savefig(path, dpi=100)


if __name__ == "__main__":
    main()
