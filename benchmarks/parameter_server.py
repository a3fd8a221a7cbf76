"""Parameter-server training: keras_dist's coordinator against a hand-written raw-gRPC async PS.

In one invocation, on this machine: an MLP 784-512-512-10 with SGD, per-worker batch 64,
2 workers and 1 ps, asynchronous:

(a) keras_dist: ``ParameterServerStrategy`` + ``ClusterCoordinator`` on a cluster of
    local processes (``kd.testing.create_multi_process_cluster``); the coordinator
    schedules a train step (``kd.value_and_grad`` + ``optimizer.apply``) that reads a
    per-worker dataset;
(b) the baseline: a minimal hand-written async PS over grpcio in the same number of
    processes: each worker computes its gradient with ``jax.jit`` and sends it in one RPC
    whose reply carries the new weights; the ps applies SGD in NumPy;
(c) the limit: the same jitted SGD step in one process, no transport.

    python benchmarks/parameter_server.py [--steps 200] [--repeats 3]

Prints one line: the rates (steps/s, totals over the workers; median of the repeats) and
keras_dist / baseline. Where TensorFlow is installed (in this Python, or in the one given with
``--tf-python``), a second line compares keras_dist with TF's own ``ParameterServerStrategy``
and ``ClusterCoordinator`` on the same workload (``_tf_parameter_server.py``, its own process).

    python benchmarks/parameter_server.py --steps-per-function 8 [--tf-python PYTHON]

prints instead keras_dist's rate when each scheduled function runs 8 steps (a loop over
``next(iterator)``; TF's side, a ``tf.range`` loop in its ``tf.function``), against TF's where
TensorFlow is found, else against one step a function. keras_dist's worker reads the variables
and sends the updates once a function; TF's reads and updates the ps at every step.

    python benchmarks/parameter_server.py --scaling [--steps 100] [--repeats 1]

prints instead keras_dist's rate for 1, 2 and 4 workers and 1 and 2 ps tasks (a Markdown
table: steps/s, microseconds per step, and what a step costs over the one-process jitted
step), then one summary line.
"""

import argparse
import multiprocessing
import statistics
import threading
import time

import numpy as np
from _ps_workload import BATCH
from _ps_workload import LR
from _ps_workload import SIZES
from _ps_workload import batches as _batches
from _ps_workload import init_params as _init_params
from _ps_workload import scheduled_rates
from _ps_workload import shapes as _shapes


def _jax_loss():
    import jax
    import jax.numpy as jnp

    def loss(params, x, y):
        h = x
        for i in range(0, len(params) - 2, 2):
            h = jax.nn.relu(h @ params[i] + params[i + 1])
        logits = h @ params[-2] + params[-1]
        return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), y[:, None], 1))

    return loss


# ----------------------------------------------------------------- (b) the baseline
_SERVICE, _METHOD = "baseline.PS", "Push"


def _to_bytes(arrays):
    # One copy, as keras_dist's own messages: the buffers joined as they are.
    return b"".join(np.ascontiguousarray(a).data for a in arrays)


def _from_bytes(data):
    arrays, offset = [], 0
    for shape in _shapes():
        count = int(np.prod(shape))
        arrays.append(np.frombuffer(data, "float32", count, offset).reshape(shape))
        offset += 4 * count
    return arrays


def _baseline_ps(port, ready):
    import concurrent.futures

    import grpc

    params = _init_params()
    lock = threading.Lock()

    def push(request, context):
        grads = _from_bytes(request)
        with lock:
            for p, g in zip(params, grads):
                p -= LR * g
            return _to_bytes(params)

    server = grpc.server(
        concurrent.futures.ThreadPoolExecutor(4),
        options=[("grpc.max_send_message_length", -1), ("grpc.max_receive_message_length", -1)],
    )
    handler = grpc.unary_unary_rpc_method_handler(push)
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler(_SERVICE, {_METHOD: handler}),)
    )
    server.add_insecure_port(f"127.0.0.1:{port}")
    server.start()
    ready.set()
    server.wait_for_termination()


def _baseline_worker(port, index, steps, start, results):
    import grpc
    import jax

    grad = jax.jit(jax.grad(_jax_loss()))
    channel = grpc.insecure_channel(
        f"127.0.0.1:{port}",
        options=[("grpc.max_send_message_length", -1), ("grpc.max_receive_message_length", -1)],
    )
    call = channel.unary_unary(f"/{_SERVICE}/{_METHOD}")
    xs, ys = _batches(index)
    params = _init_params()
    params = _from_bytes(call(_to_bytes([np.zeros_like(p) for p in params])))
    grad(params, xs[0], ys[0])  # compile
    start.wait()
    began = time.perf_counter()
    for step in range(steps):
        grads = grad(params, xs[step % len(xs)], ys[step % len(ys)])
        params = _from_bytes(call(_to_bytes([np.asarray(g) for g in grads])))
    results.put((began, time.perf_counter()))


def baseline_rate(steps, workers=2):
    import keras_dist as kd

    context = multiprocessing.get_context("spawn")
    port = kd.testing.pick_unused_port()
    ready, start, results = context.Event(), context.Event(), context.Queue()
    ps = context.Process(target=_baseline_ps, args=(port, ready), daemon=True)
    ps.start()
    ready.wait(60)
    per_worker = steps // workers
    procs = [
        context.Process(target=_baseline_worker, args=(port, i, per_worker, start, results))
        for i in range(workers)
    ]
    for p in procs:
        p.start()
    time.sleep(5)  # let both compile before the common start
    start.set()
    spans = [results.get(timeout=300) for _ in procs]
    for p in procs:
        p.join(30)
    ps.kill()
    wall = max(end for _, end in spans) - min(begin for begin, _ in spans)
    return per_worker * workers / wall


# ----------------------------------------------------------------- (a) keras_dist
def keras_dist_rates(steps, repeats, workers=2, num_ps=1, per_function=1):
    import keras_dist as kd  # first: it selects Keras's JAX backend

    import keras  # isort: skip

    cluster = kd.testing.create_multi_process_cluster(num_workers=workers, num_ps=num_ps)
    try:
        strategy = kd.ParameterServerStrategy(cluster.cluster_resolver)
        coordinator = kd.coordinator.ClusterCoordinator(strategy)
        with strategy.scope():
            model = keras.Sequential(
                [keras.Input((SIZES[0],))]
                + [keras.layers.Dense(n, activation="relu") for n in SIZES[1:-1]]
                + [keras.layers.Dense(SIZES[-1])]
            )
            optimizer = keras.optimizers.SGD(LR)
            optimizer.build(model.trainable_variables)
        loss_object = keras.losses.SparseCategoricalCrossentropy(from_logits=True)

        def dataset_fn(context):
            xs, ys = _batches(context.input_pipeline_id)
            while True:
                yield from zip(xs, ys)

        def step_fn(iterator):
            for _ in range(per_function):
                x, y = next(iterator)
                loss, grads = kd.value_and_grad(
                    lambda: loss_object(y, model(x)), model.trainable_variables
                )()
                optimizer.apply(grads, model.trainable_variables)
            return loss

        iterator = iter(coordinator.create_per_worker_dataset(dataset_fn))
        return scheduled_rates(
            coordinator, step_fn, iterator, workers, steps, repeats, per_function
        )
    finally:
        cluster.stop()


# ----------------------------------------------------------------- (c) the limit
def jit_rate(steps):
    import jax

    loss = _jax_loss()

    @jax.jit
    def step(params, x, y):
        grads = jax.grad(loss)(params, x, y)
        return [p - LR * g for p, g in zip(params, grads)]

    params = _init_params()
    xs, ys = _batches(0)
    params = step(params, xs[0], ys[0])
    jax.block_until_ready(params)
    began = time.perf_counter()
    for i in range(steps):
        params = step(params, xs[i % len(xs)], ys[i % len(ys)])
        jax.block_until_ready(params)
    return steps / (time.perf_counter() - began)


def scaling(steps, repeats):
    """A table and a line: keras_dist's rate for 1, 2, 4 workers and 1, 2 ps."""
    limit = jit_rate(steps)
    rows = []
    for num_ps in (1, 2):
        for workers in (1, 2, 4):
            rate = statistics.median(keras_dist_rates(steps, repeats, workers, num_ps))
            rows.append((workers, num_ps, rate))
            print(f"  measured {workers} workers, {num_ps} ps", flush=True)
    print()
    print("| workers | ps | steps/s (all workers) | µs per step | over one process's step µs |")
    print("| ---: | ---: | ---: | ---: | ---: |")
    for workers, num_ps, rate in rows:
        print(
            f"| {workers} | {num_ps} | {rate:.0f} | {1e6 / rate:.0f} | "
            f"{1e6 / rate - 1e6 / limit:.0f} |"
        )
    best = max(rows, key=lambda row: row[2])
    print(
        f"parameter_server scaling: {min(r[2] for r in rows):.0f} to {max(r[2] for r in rows):.0f} "
        f"steps/s over 1-4 workers x 1-2 ps (best: {best[0]} workers, {best[1]} ps); one-process "
        f"jitted step {limit:.0f} steps/s [cpu, MLP 784-512-512-10, SGD, per-worker batch "
        f"{BATCH}, median of {repeats} x {steps} steps]"
    )


def tf_rate(python, steps, repeats, per_function=1):
    """TF's rate on the same workload, from ``_tf_parameter_server.py`` run by ``python``."""
    import os
    import re
    import subprocess
    import sys

    script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_tf_parameter_server.py")
    command = [python or sys.executable, script, "--steps", str(steps), "--repeats", str(repeats)]
    command += ["--steps-per-function", str(per_function)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=900)
    match = re.search(r"TF ClusterCoordinator (\d+) steps/s", done.stdout)
    if match is None:
        raise RuntimeError(
            f"The TF baseline failed (exit {done.returncode}):\n{done.stderr[-3000:]}"
        )
    return float(match.group(1))


def main():
    import importlib.util

    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=200, help="steps per timing, all workers")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--scaling", action="store_true", help="1, 2, 4 workers x 1, 2 ps")
    parser.add_argument("--tf-python", default=None, help="a Python with TensorFlow installed")
    parser.add_argument(
        "--steps-per-function", type=int, default=1, help="steps a scheduled function runs"
    )
    args = parser.parse_args()
    if args.scaling:
        scaling(args.steps, args.repeats)
        return
    if args.steps_per_function > 1:
        steps_per_function(args)
        return
    ours = statistics.median(keras_dist_rates(args.steps, args.repeats))
    baseline = statistics.median(baseline_rate(args.steps) for _ in range(args.repeats))
    limit = jit_rate(args.steps)
    print(
        f"parameter_server: keras_dist ClusterCoordinator {ours:.0f} steps/s vs hand-written "
        f"raw-gRPC async PS {baseline:.0f} steps/s, ratio {ours / baseline:.2f}; one-process "
        f"jitted step {limit:.0f} steps/s (the limit) [cpu, MLP 784-512-512-10, SGD, 2 workers "
        f"+ 1 ps, per-worker batch {BATCH}, median of {args.repeats} x {args.steps} steps]"
    )
    if args.tf_python or importlib.util.find_spec("tensorflow") is not None:
        tf = tf_rate(args.tf_python, args.steps, args.repeats)
        print(
            f"parameter_server vs TF: keras_dist ClusterCoordinator {ours:.0f} steps/s vs TF "
            f"ClusterCoordinator {tf:.0f} steps/s, ratio {ours / tf:.2f} (target >= 2.0) [cpu, "
            f"same workload, median of {args.repeats} x {args.steps} steps]"
        )


def steps_per_function(args):
    """keras_dist's rate with several steps in each scheduled function, against one step a
    function and, where TensorFlow is installed, against TF with the same loop."""
    import importlib.util

    k = args.steps_per_function
    many = statistics.median(keras_dist_rates(args.steps, args.repeats, per_function=k))
    one = statistics.median(keras_dist_rates(args.steps, args.repeats))
    against = f"1 step a function {one:.0f} steps/s, ratio {many / one:.2f}"
    if args.tf_python or importlib.util.find_spec("tensorflow") is not None:
        tf = tf_rate(args.tf_python, args.steps, args.repeats, per_function=k)
        against = f"TF ClusterCoordinator {tf:.0f} steps/s, ratio {many / tf:.2f} (target >= 2.0)"
    print(
        f"parameter_server, {k} steps a scheduled function: keras_dist {many:.0f} steps/s vs "
        f"{against} [cpu, MLP 784-512-512-10, SGD, 2 workers + 1 ps, per-worker batch {BATCH}, "
        f"median of {args.repeats} x {args.steps} steps]"
    )


if __name__ == "__main__":
    main()
