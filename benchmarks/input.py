"""``fit`` throughput with an input pipeline that waits on storage, with and without prefetch.

The pipeline is a ``keras.utils.PyDataset`` whose every batch first waits
(``time.sleep``, as a read from network storage would) about as long as one
training step takes; ``fit`` runs under ``MirroredStrategy`` on simulated
devices. With ``kd.config.set_prefetch_buffer_size(0)`` each batch is read
when the step needs it; with the default the next batches are read on a
background thread while the step computes. Both run alternately in one
invocation.

    python benchmarks/input.py [--devices 4] [--batch 256] [--steps 40]

Prints one line: steps/s without and with prefetch and their ratio (median).
"""

import argparse
import os
import statistics
import time

from _platform import simulate_cpu_devices

parser = argparse.ArgumentParser(description=__doc__)
parser.add_argument("--devices", type=int, default=4)
parser.add_argument("--batch", type=int, default=256, help="global batch size")
parser.add_argument("--steps", type=int, default=40, help="batches per epoch")
parser.add_argument("--repeats", type=int, default=5)
args = parser.parse_args()
simulate_cpu_devices(args.devices)
os.environ.setdefault("KERAS_BACKEND", "jax")

import keras  # noqa: E402
import numpy as np  # noqa: E402

import keras_dist as kd  # noqa: E402


class SlowStorage(keras.utils.PyDataset):
    """Batches that each take ``latency`` seconds to arrive."""

    def __init__(self, x, y, latency):
        super().__init__()
        self.x, self.y, self.latency = x, y, latency

    def __len__(self):
        return args.steps

    def __getitem__(self, index):
        time.sleep(self.latency)
        rows = slice(index * args.batch, (index + 1) * args.batch)
        return self.x[rows], self.y[rows]


def main():
    rng = np.random.default_rng(0)
    rows = args.batch * args.steps
    x = rng.normal(size=(rows, 128)).astype("float32")
    y = rng.integers(0, 10, rows).astype("int32")
    strategy = kd.MirroredStrategy()
    keras.utils.set_random_seed(0)
    with strategy.scope():
        model = keras.Sequential(
            [
                keras.Input((128,)),
                keras.layers.Dense(512, activation="relu"),
                keras.layers.Dense(512, activation="relu"),
                keras.layers.Dense(10),
            ]
        )
        model.compile(
            optimizer=keras.optimizers.SGD(0.01, momentum=0.9),
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        )

    def epoch(data):
        start = time.perf_counter()
        model.fit(data, epochs=1, verbose=0, shuffle=False)
        return args.steps / (time.perf_counter() - start)

    # The step time without waits sets the storage latency: about one step.
    epoch(SlowStorage(x, y, 0.0))
    step_seconds = 1.0 / statistics.median(epoch(SlowStorage(x, y, 0.0)) for _ in range(3))
    slow = SlowStorage(x, y, step_seconds)
    without, with_prefetch = [], []
    for _ in range(args.repeats):
        kd.config.set_prefetch_buffer_size(0)
        without.append(epoch(slow))
        kd.config.set_prefetch_buffer_size(2)
        with_prefetch.append(epoch(slow))
    ratios = [b / a for a, b in zip(without, with_prefetch)]
    print(
        f"input: fit with {step_seconds * 1e3:.1f} ms of storage latency per batch: "
        f"no prefetch {statistics.median(without):.0f} steps/s, prefetch "
        f"{statistics.median(with_prefetch):.0f} steps/s, ratio {statistics.median(ratios):.2f} "
        f"(target >= 1.5; {strategy.num_replicas_in_sync} x cpu, global batch {args.batch}, "
        f"median of {args.repeats} x {args.steps} steps)"
    )


if __name__ == "__main__":
    main()
