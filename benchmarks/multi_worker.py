"""What crossing processes costs: ``fit`` on 2 processes x 1 device against 1 process x 2 devices.

In one invocation, on the same machine, the same model, data and global batch:

(a) ``MultiWorkerMirroredStrategy`` in two local processes with one CPU device each
    (``kd.launch``; gloo collectives through 127.0.0.1);
(b) ``MirroredStrategy`` in one process with two simulated CPU devices (also started
    with ``kd.launch``, so both pay the same process start-up outside the timing);
(c) for reference, the hand-written ``jax.jit(jax.shard_map(...))`` step of the same
    model (benchmarks/_jit_baseline.py) in the same two processes: what JAX itself
    costs across processes, against which (a) shows keras_dist's own overhead.

    python benchmarks/multi_worker.py [--batch 256] [--steps 100] [--repeats 5]

Prints one line: the throughputs (median of the repeats, timed inside the workers)
and the ratio (a) / (b), then (a) against (c).

    python benchmarks/multi_worker.py --collectives [--sizes 4096,2800000,67108864]

measures the collective alone instead, on the same 2 processes: per array size
(bytes of float32), a hand-written ``jax.jit(shard_map(psum))`` on the 2-process
mesh against keras_dist's ``strategy.reduce("SUM", ...)`` and ``strategy.run`` with
``all_reduce`` of the same per-replica value; one line with the milliseconds per
call (median) and the ratios to the psum.
"""

import argparse
import statistics

import keras_dist as kd

FEATURES, HIDDEN, CLASSES = 128, 512, 10


def _import_benchmarks():
    """Lets a worker import this folder's modules (it runs from a pickled function)."""
    import os
    import sys

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def epoch_rates(epoch, steps, repeats):
    """Steps per second of ``repeats`` calls of ``epoch`` (after one that compiles)."""
    import time

    epoch()
    rates = []
    for _ in range(repeats):
        start = time.perf_counter()
        epoch()
        rates.append(steps / (time.perf_counter() - start))
    return rates


def measure(strategy_name, batch, steps, repeats):
    """Runs in each worker: steps per second of one epoch of ``steps`` batches, per repeat."""

    import keras_dist as kd

    if strategy_name == "multi_worker":
        strategy = kd.MultiWorkerMirroredStrategy()
    else:
        strategy = kd.MirroredStrategy()
    import numpy as np

    _import_benchmarks()
    from _jit_baseline import keras_mlp

    with strategy.scope():
        model = keras_mlp(FEATURES, HIDDEN, CLASSES, 0.01, 0.9)
    rng = np.random.default_rng(0)
    x = rng.normal(size=(batch * steps, FEATURES)).astype("float32")
    y = rng.integers(0, CLASSES, batch * steps).astype("int32")

    def epoch():
        model.fit(x, y, batch_size=batch, epochs=1, shuffle=False, verbose=0)

    return epoch_rates(epoch, steps, repeats)


def measure_jit(batch, steps, repeats):
    """Runs in each worker: steps per second of the hand-written step across processes."""

    import keras_dist as kd

    kd.MultiWorkerMirroredStrategy()  # starts jax.distributed from TF_CONFIG
    import jax
    import numpy as np
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    _import_benchmarks()
    from _jit_baseline import mlp_train_step

    mesh = jax.sharding.Mesh(np.array(jax.devices()), ("replica",))
    replicated, split = NamedSharding(mesh, P()), NamedSharding(mesh, P("replica"))
    rng = np.random.default_rng(0)
    shapes = [
        (FEATURES, HIDDEN),
        (HIDDEN,),
        (HIDDEN, HIDDEN),
        (HIDDEN,),
        (HIDDEN, CLASSES),
        (CLASSES,),
    ]

    def replicate(a):
        return jax.make_array_from_callback(a.shape, replicated, lambda index: a[index])

    state = {
        "params": [replicate(rng.normal(size=s).astype("float32") * 0.05) for s in shapes],
        "velocity": [replicate(np.zeros(s, "float32")) for s in shapes],
    }
    step = mlp_train_step(mesh, batch, 0.01, 0.9)
    rows = batch // jax.process_count()
    x = rng.normal(size=(batch * steps, FEATURES)).astype("float32")
    y = rng.integers(0, CLASSES, batch * steps).astype("int32")
    mine = slice(jax.process_index() * rows, (jax.process_index() + 1) * rows)

    def epoch():
        for start in range(0, len(x), batch):
            xb = jax.make_array_from_process_local_data(
                split, x[start : start + batch][mine], (batch, FEATURES)
            )
            yb = jax.make_array_from_process_local_data(
                split, y[start : start + batch][mine], (batch,)
            )
            state["params"], state["velocity"], loss = step(
                state["params"], state["velocity"], xb, yb
            )
            loss.block_until_ready()  # one execution in flight (see docs/architecture.md)

    return epoch_rates(epoch, steps, repeats)


def measure_collectives(sizes, calls):
    """Runs in each worker: ms per call of psum, ``reduce`` and ``run`` + ``all_reduce``."""
    import time

    import keras_dist as kd

    strategy = kd.MultiWorkerMirroredStrategy()
    import jax
    import numpy as np
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    mesh = jax.sharding.Mesh(np.array(jax.devices()), ("replica",))
    split = NamedSharding(mesh, P("replica"))
    psum = jax.jit(
        jax.shard_map(
            lambda x: jax.lax.psum(x, "replica"), mesh=mesh, in_specs=P("replica"), out_specs=P()
        )
    )

    def all_reduce(x):
        return kd.get_replica_context().all_reduce("SUM", x)

    def timed(variants):
        """Median ms per call of each variant, called in turn in shuffled order (the same noise)."""
        for fn in variants:
            jax.block_until_ready(fn())  # compile
        times = [[] for _ in variants]
        # A new order each round, the same in every process (their collectives must match).
        order = np.random.default_rng(0)
        for _ in range(calls):
            for i in order.permutation(len(variants)):
                start = time.perf_counter()
                jax.block_until_ready(variants[i]())
                times[i].append((time.perf_counter() - start) * 1e3)
        # Medians of the times, and of each call's time over the psum's in the same round.
        ratios = [statistics.median(a / b for a, b in zip(t, times[0])) for t in times[1:]]
        return [statistics.median(t) for t in times], ratios

    results = []
    for size in sizes:
        n = size // 4
        local = np.full((1, n), float(jax.process_index() + 1), np.float32)
        stacked = jax.make_array_from_process_local_data(split, local, (jax.process_count(), n))
        value = strategy.experimental_distribute_values_from_function(
            lambda context, n=n: np.full((n,), context.replica_id_in_sync_group + 1.0, "f4")
        )
        (raw, reduce, run), ratios = timed(
            [
                lambda stacked=stacked: psum(stacked),
                lambda value=value: strategy.reduce("SUM", value, axis=None),
                lambda value=value: strategy.experimental_local_results(
                    strategy.run(all_reduce, args=(value,))
                ),
            ]
        )
        results.append((size, raw, reduce, run, ratios))
    return results


def collectives_line(sizes, calls):
    """Launches 2 processes of one device each; the line for the chief's timings."""
    results = kd.launch(
        measure_collectives,
        num_workers=2,
        devices_per_worker=1,
        args=(sizes, calls),
        stream_output=False,
        timeout=900,
    )[0]
    parts = []
    for size, raw, reduce, run, (reduce_ratio, run_ratio) in results:
        label = f"{size / 2**20:.1f} MB" if size >= 2**20 else f"{size / 1024:.0f} KB"
        parts.append(
            f"{label}: psum {raw:.2f} ms, kd reduce {reduce:.2f} ms ({reduce_ratio:.2f}x), "
            f"run+all_reduce {run:.2f} ms ({run_ratio:.2f}x)"
        )
    return (
        "multi_worker collectives (2 processes x 1 cpu device, gloo; target <= 1.15x): "
        + "; ".join(parts)
        + f" [medians of {calls} rounds of the three in shuffled order; ratios: medians of "
        "each round's]"
    )


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--batch", type=int, default=256, help="global batch size")
    parser.add_argument("--steps", type=int, default=100, help="steps per epoch")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--collectives", action="store_true", help="time the collective alone")
    parser.add_argument("--sizes", default="4096,2800000,67108864", help="bytes per array")
    parser.add_argument("--calls", type=int, default=60, help="timed calls per size")
    args = parser.parse_args()
    if args.collectives:
        print(collectives_line([int(s) for s in args.sizes.split(",")], args.calls))
        return
    work = (args.batch, args.steps, args.repeats)

    def chief_rates(fn, workers, devices, *fn_args):
        """Starts ``workers`` processes of ``devices`` devices; the chief's rates."""
        results = kd.launch(
            fn,
            num_workers=workers,
            devices_per_worker=devices,
            args=fn_args + work,
            stream_output=False,
            timeout=900,
        )
        # Every worker times the same synchronous steps: the chief's figures stand for all.
        return statistics.median(results[0])

    across = chief_rates(measure, 2, 1, "multi_worker")
    within = chief_rates(measure, 1, 2, "mirrored")
    jax_across = chief_rates(measure_jit, 2, 1)
    print(
        f"multi_worker: fit on 2 processes x 1 device {across:.0f} steps/s vs 1 process x 2 "
        f"devices {within:.0f} steps/s, ratio {across / within:.2f} (the cost of crossing "
        f"processes); hand-written jax.jit step on the same 2 processes {jax_across:.0f} "
        f"steps/s, keras_dist/jax ratio {across / jax_across:.2f} [cpu, global batch "
        f"{args.batch}, median of {args.repeats} x {args.steps} steps]"
    )


if __name__ == "__main__":
    main()
