"""``fit`` when every batch splits unevenly between the replicas (30 rows on 4 replicas).

Such a batch cannot run as the SPMD step; ``fit`` runs it exactly, either as one
program of every replica (``strategy.run``'s uneven engine, the default on one
process's CPU devices) or as one program per replica shape (the default on
accelerators). In one invocation, on the same data and model, this times:

(a) fit with the uneven batch size, each way;
(b) fit with the nearest even batch size (the SPMD step), the reference.

    python benchmarks/uneven_fit.py [--devices 4] [--batch 30] [--rows 600]

Prints one line: ms per step of each, and the slowdowns against the even step
(medians of the repeats).
"""

import argparse
import os
import statistics
import time
import warnings

from _platform import simulate_cpu_devices

parser = argparse.ArgumentParser(description=__doc__)
parser.add_argument("--devices", type=int, default=4)
parser.add_argument("--batch", type=int, default=30, help="an uneven global batch size")
parser.add_argument("--rows", type=int, default=600)
parser.add_argument("--repeats", type=int, default=5)
args = parser.parse_args()
simulate_cpu_devices(args.devices)
os.environ.setdefault("KERAS_BACKEND", "jax")

import keras  # noqa: E402
import numpy as np  # noqa: E402

import keras_dist as kd  # noqa: E402
from keras_dist._keras_steps import _steps  # noqa: E402

warnings.simplefilter("ignore")  # (the uneven batch size's warning: wanted here)


def fit_runner(strategy, batch_size, x, y):
    with strategy.scope():
        keras.utils.set_random_seed(0)
        inputs = keras.Input((x.shape[1],))
        hidden = keras.layers.Dense(32, activation="relu")(inputs)
        model = keras.Model(inputs, keras.layers.Dense(1)(hidden))
        model.compile(optimizer="adam", loss="mse", metrics=["mae"])

    def run():
        model.fit(x, y, batch_size=batch_size, epochs=1, shuffle=False, verbose=0)

    run()  # compile
    return run


def ms_per_step(run, steps):
    start = time.perf_counter()
    run()
    return 1000 * (time.perf_counter() - start) / steps


def main():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(args.rows, 16)).astype("float32")
    y = 2 * x[:, :1]
    strategy = kd.MirroredStrategy()
    n = strategy.num_replicas_in_sync
    even = max(n, round(args.batch / n) * n)
    default_path = _steps.uneven_in_one_program(strategy.extended)
    runs = {
        "one program": (lambda extended: True, args.batch),
        "per replica": (lambda extended: False, args.batch),
        "even": (_steps.uneven_in_one_program, even),
    }
    original = _steps.uneven_in_one_program
    timed = {}
    for name, (choice, batch) in runs.items():
        _steps.uneven_in_one_program = choice
        try:
            run = fit_runner(strategy, batch, x, y)
            steps = -(-args.rows // batch)
            timed[name] = statistics.median(ms_per_step(run, steps) for _ in range(args.repeats))
        finally:
            _steps.uneven_in_one_program = original
    base = timed["even"]
    print(
        f"uneven_fit: batch {args.batch} on {n} replicas as one program "
        f"{timed['one program']:.2f} ms/step ({timed['one program'] / base:.1f}x), per "
        f"replica {timed['per replica']:.2f} ms/step ({timed['per replica'] / base:.1f}x); "
        f"even batch {even} {base:.2f} ms/step [{n} x {strategy.extended.local_devices[0].platform}"
        f", default here: {'one program' if default_path else 'per replica'}, {args.rows} rows, "
        f"median of {args.repeats}]"
    )


if __name__ == "__main__":
    main()
