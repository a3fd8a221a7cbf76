"""``fit`` of a model after variables were created beside it: program kept vs compiled again.

Every compiled program threads all of its strategy's variables, so a variable
created in the scope (a second model, a metric) changes every program's key.
keras_dist traces the function again and keeps its program when that trace is
the same program (``keras_dist/_engine/_program_reuse.py``). In one invocation,
on the same devices (MirroredStrategy over every local device; 2 simulated
devices on CPU), this times one epoch of ``fit`` of a model right after another
model was built in the same scope, with the program kept and, for the baseline,
compiled again as before (the engine told to keep nothing), and the same epoch
with nothing new beside it.

    python benchmarks/new_variables.py [--model cnn] [--repeats 3]

Prints one line: both times, their ratio, and the plain epoch's time.
"""

import argparse
import os
import statistics
import time

from _platform import simulate_cpu_devices

parser = argparse.ArgumentParser(description=__doc__)
parser.add_argument("--model", choices=["cnn", "mlp"], default="cnn")
parser.add_argument("--batch", type=int, default=32, help="global batch size")
parser.add_argument("--steps", type=int, default=8, help="steps per epoch")
parser.add_argument("--repeats", type=int, default=3)
args = parser.parse_args()
simulate_cpu_devices(2)
os.environ.setdefault("KERAS_BACKEND", "jax")

import jax  # noqa: E402
import keras  # noqa: E402
import numpy as np  # noqa: E402
from _image_models import image_classifier  # noqa: E402

import keras_dist as kd  # noqa: E402

# The baseline: an engine that never keeps a program (as before the check existed).
from keras_dist._engine import CompiledEngine  # noqa: E402


def build(strategy):
    with strategy.scope():
        model = image_classifier(args.model)
        model.compile(
            keras.optimizers.Adam(0.001),
            keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            metrics=["accuracy"],
        )
    return model


def main():
    rng = np.random.default_rng(0)
    x = rng.random((args.batch * args.steps, 32, 32, 3), dtype=np.float32)
    y = rng.integers(0, 10, args.batch * args.steps)
    strategy = kd.MirroredStrategy()
    model = build(strategy)

    def epoch():
        start = time.perf_counter()
        model.fit(x, y, batch_size=args.batch, epochs=1, shuffle=False, verbose=0)
        return time.perf_counter() - start

    epoch()  # compiles
    kept = CompiledEngine._kept
    times = {"kept": [], "compiled again": [], "plain": []}
    for _ in range(args.repeats):
        for form in times:
            if form != "plain":
                CompiledEngine._kept = kept if form == "kept" else lambda *a, **k: None
                build(strategy).build((None, 32, 32, 3))  # another model beside it
            times[form].append(epoch())
    CompiledEngine._kept = kept
    med = {form: statistics.median(t) for form, t in times.items()}
    print(
        f"new_variables: fit after another model was built beside it {med['kept']:.2f} s "
        f"(program kept) vs {med['compiled again']:.2f} s (compiled again), ratio "
        f"{med['compiled again'] / med['kept']:.1f}x; the same epoch with nothing new "
        f"{med['plain']:.2f} s [{strategy.num_replicas_in_sync} x "
        f"{jax.devices()[0].platform}, {args.model}, {args.steps} steps of global batch "
        f"{args.batch}, median of {args.repeats}]"
    )


if __name__ == "__main__":
    main()
