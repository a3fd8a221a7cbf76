"""Cost of a custom loop's partial last batch: the compiled uneven step vs. the eager engine.

The last global batch of an epoch (``--rows``, default 178 rows on 4 replicas:
45/45/45/43 as TF splits it) cannot run as one SPMD program. keras_dist compiles
it as one program traced per replica shape (``_engine/_uneven.py``); before, it
ran on the eager engine, one thread per replica, op by op. Both run the
example's model and step (examples/custom_training_loop.py) in this process, on
fresh models, and are timed on their first call (what an epoch pays once) and
on later calls.

    python benchmarks/partial_batch.py [--devices 4] [--rows 178] [--repeats 5]

Prints one line: first-call seconds of each, per-call milliseconds of each
(median of the repeats), and the ratio eager / compiled per call.
"""

import argparse
import os
import statistics
import sys
import time

from _platform import simulate_cpu_devices

parser = argparse.ArgumentParser(description=__doc__)
parser.add_argument("--devices", type=int, default=4)
parser.add_argument("--rows", type=int, default=178, help="rows of the partial batch")
parser.add_argument("--repeats", type=int, default=5)
args = parser.parse_args()
simulate_cpu_devices(args.devices)
os.environ.setdefault("KERAS_BACKEND", "jax")
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "examples"))

import jax  # noqa: E402
import keras  # noqa: E402
import numpy as np  # noqa: E402
from custom_training_loop import build_model  # noqa: E402
from custom_training_loop import make_train_step  # noqa: E402

import keras_dist as kd  # noqa: E402


def partial_batch_runner(eagerly):
    """A fresh model and a step on the partial batch; returns a function timing one call."""
    keras.utils.set_random_seed(0)
    rng = np.random.default_rng(0)
    batch = (
        rng.random((args.rows, 64), dtype=np.float32),
        rng.integers(0, 10, args.rows).astype("int32"),
    )
    strategy = kd.MirroredStrategy()
    with strategy.scope():
        model = build_model()
        optimizer = keras.optimizers.SGD(0.05, momentum=0.9)
        optimizer.build(model.trainable_variables)
    train_step = make_train_step(model, optimizer, global_batch_size=args.rows)
    (data,) = list(strategy.experimental_distribute_dataset([batch]))

    def call():
        kd.config.run_functions_eagerly(eagerly)
        try:
            start = time.perf_counter()
            loss = strategy.reduce("SUM", strategy.run(train_step, args=(data,)), None)
            jax.block_until_ready(loss)
            return time.perf_counter() - start
        finally:
            kd.config.run_functions_eagerly(False)

    call.data = data
    return call, strategy


def main():
    compiled, strategy = partial_batch_runner(eagerly=False)
    eager, _ = partial_batch_runner(eagerly=True)
    compiled_first, eager_first = compiled(), eager()
    compiled_times = [compiled() for _ in range(args.repeats)]
    eager_times = [eager() for _ in range(args.repeats)]
    compiled_ms = statistics.median(compiled_times) * 1e3
    eager_ms = statistics.median(eager_times) * 1e3
    shapes = [np.shape(x) for x in strategy.experimental_local_results(compiled.data[0])]
    sizes = "/".join(str(shape[0]) for shape in shapes)
    print(
        f"partial_batch: compiled uneven step first call {compiled_first:.2f} s, then "
        f"{compiled_ms:.1f} ms; eager engine first call {eager_first:.2f} s, then "
        f"{eager_ms:.1f} ms; per-call ratio {eager_ms / compiled_ms:.1f}x "
        f"({args.rows} rows split {sizes} on {strategy.num_replicas_in_sync} x "
        f"{strategy.extended.local_devices[0].platform}, median of {args.repeats})"
    )


if __name__ == "__main__":
    main()
