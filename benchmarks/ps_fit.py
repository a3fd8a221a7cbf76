"""``model.fit`` under ``ParameterServerStrategy``: ``steps_per_execution`` against one step a call.

In one invocation, on a cluster of local processes (2 workers, 1 ps;
``kd.testing.create_multi_process_cluster``): the parameter-server benchmark's MLP
784-512-512-10 with SGD, compiled twice, with ``steps_per_execution=1`` and with
``--steps-per-execution`` (8), each fit on the same NumPy data (batch 64), alternating.
With more than one step a call, a worker runs that many steps in one scheduled
function: one request, its variables read once and its updates sent once.

    python benchmarks/ps_fit.py [--steps 256] [--repeats 3] [--steps-per-execution 8]

Prints one line: the two rates (steps/s, median of the repeats) and their ratio.
"""

import argparse
import statistics
import time

from _ps_workload import BATCH
from _ps_workload import LR
from _ps_workload import SIZES
from _ps_workload import batches


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=256, help="steps per timed fit")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps-per-execution", type=int, default=8)
    args = parser.parse_args()

    import keras_dist as kd  # first: it selects Keras's JAX backend

    import keras  # isort: skip

    xs, ys = batches(0, count=args.steps)
    x, y = xs.reshape(-1, SIZES[0]), ys.reshape(-1)
    cluster = kd.testing.create_multi_process_cluster(num_workers=2, num_ps=1)
    try:
        strategy = kd.ParameterServerStrategy(cluster.cluster_resolver)

        def fit_runner(steps_per_execution):
            with strategy.scope():
                keras.utils.set_random_seed(0)
                model = keras.Sequential(
                    [keras.Input((SIZES[0],))]
                    + [keras.layers.Dense(n, activation="relu") for n in SIZES[1:-1]]
                    + [keras.layers.Dense(SIZES[-1])]
                )
                model.compile(
                    keras.optimizers.SGD(LR),
                    keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                    steps_per_execution=steps_per_execution,
                )

            def run():
                model.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)

            return run

        runners = {1: fit_runner(1), args.steps_per_execution: fit_runner(args.steps_per_execution)}
        for run in runners.values():
            run()  # trace, send and compile on every worker
        rates = {k: [] for k in runners}
        for _ in range(args.repeats):
            for k, run in runners.items():
                began = time.perf_counter()
                run()
                rates[k].append(args.steps / (time.perf_counter() - began))
    finally:
        cluster.stop()
    many, one = (statistics.median(rates[k]) for k in (args.steps_per_execution, 1))
    ratios = [a / b for a, b in zip(rates[args.steps_per_execution], rates[1])]
    print(
        f"ps_fit: steps_per_execution={args.steps_per_execution} {many:.0f} steps/s vs "
        f"steps_per_execution=1 {one:.0f} steps/s, ratio {statistics.median(ratios):.2f} "
        f"[cpu, MLP {'-'.join(map(str, SIZES))}, SGD, 2 workers + 1 ps, batch {BATCH}, "
        f"{args.steps} steps a fit, median of {args.repeats}]",
        flush=True,
    )


if __name__ == "__main__":
    main()
