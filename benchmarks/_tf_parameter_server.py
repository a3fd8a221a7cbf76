"""TensorFlow's own parameter servers on ``parameter_server.py``'s workload: the TF baseline.

TF 2.21's ``tf.distribute.experimental.ParameterServerStrategy`` and
``tf.distribute.coordinator.ClusterCoordinator`` on local processes (one
``tf.distribute.Server`` per ps and worker task on a free 127.0.0.1 port, each in a spawned
child process; this process is the chief, the coordinator), training the same MLP
784-512-512-10 (ReLU, weights normal * 0.05 from seed 0) with plain SGD (lr 0.01),
per-worker batch 64 and mean sparse softmax cross-entropy from logits, asynchronously:
worker ``i`` cycles over ``_ps_workload.batches(i)`` (16 batches, its index from
``experimental_get_current_worker_index`` in the per-worker ``dataset_fn``); the step (a
``tf.function`` that reads ``next(iterator)`` and runs, with ``strategy.run`` as TF's
tutorial writes it, a ``tf.GradientTape`` gradient and ``assign_sub`` SGD) is scheduled
``--steps`` times and joined, after a warm-up of 4 steps per worker, as
``parameter_server.keras_dist_rates`` times keras_dist. Raw TF variables, not Keras:
Keras 3 cannot run under TF's parameter servers.

It needs TensorFlow and never imports JAX or keras_dist; ``parameter_server.py`` runs it
as its own process when given a Python that has TensorFlow:

    python benchmarks/_tf_parameter_server.py [--steps 200] [--repeats 3] [--workers 2]

Prints one line: TF's rate (steps/s, totals over the workers; median of the repeats).
"""

import argparse
import multiprocessing
import os
import socket
import statistics
import sys
import threading
import time
import traceback

import numpy as np

# TF's C++ logs: its coordinator reports the task servers it loses when they are stopped.
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
os.environ["CUDA_VISIBLE_DEVICES"] = ""  # the workload of parameter_server.py: CPU

# The workload of parameter_server.py (that file imports keras_dist's side).
from _ps_workload import BATCH  # noqa: E402
from _ps_workload import LR  # noqa: E402
from _ps_workload import batches as _batches  # noqa: E402
from _ps_workload import init_params as _init_params  # noqa: E402
from _ps_workload import scheduled_rates  # noqa: E402


def _free_port():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _serve(cluster, job, index):
    """A task process: one TF server of the cluster, until it is terminated or orphaned."""
    parent = os.getppid()

    def watch():  # the chief was killed before it could terminate this task
        while os.getppid() == parent:
            time.sleep(1)
        os._exit(0)

    threading.Thread(target=watch, daemon=True).start()
    import tensorflow as tf

    server = tf.distribute.Server(
        tf.train.ClusterSpec(cluster), job_name=job, task_index=index, protocol="grpc"
    )
    server.join()


def tf_rates(steps, repeats, workers=2, per_function=1):
    """TF's steps per second, per repeat, on ``workers`` workers and 1 ps; each scheduled
    function runs ``per_function`` steps (a ``tf.range`` loop, as TF's guides write it)."""
    import tensorflow as tf

    cluster = {
        "worker": [f"127.0.0.1:{_free_port()}" for _ in range(workers)],
        "ps": [f"127.0.0.1:{_free_port()}"],
        "chief": [f"127.0.0.1:{_free_port()}"],
    }
    spawn = multiprocessing.get_context("spawn")
    tasks = [
        spawn.Process(target=_serve, args=(cluster, job, index), daemon=True)
        for job in ("worker", "ps")
        for index in range(len(cluster[job]))
    ]
    try:
        for task in tasks:
            task.start()
        resolver = tf.distribute.cluster_resolver.SimpleClusterResolver(
            tf.train.ClusterSpec(cluster), task_type="chief", task_id=0, rpc_layer="grpc"
        )
        strategy = tf.distribute.experimental.ParameterServerStrategy(resolver)
        coordinator = tf.distribute.coordinator.ClusterCoordinator(strategy)
        with strategy.scope():
            params = [tf.Variable(p) for p in _init_params()]
        data = [_batches(i) for i in range(workers)]
        all_xs = np.stack([xs for xs, _ in data])  # (workers, 16, BATCH, 784)
        all_ys = np.stack([ys for _, ys in data])

        def dataset_fn():
            index = tf.distribute.coordinator.experimental_get_current_worker_index()
            xs, ys = tf.gather(all_xs, index), tf.gather(all_ys, index)
            return tf.data.Dataset.from_tensor_slices((xs, ys)).repeat()

        def replica_fn(x, y):
            with tf.GradientTape() as tape:
                h = x
                for i in range(0, len(params) - 2, 2):
                    h = tf.nn.relu(h @ params[i] + params[i + 1])
                logits = h @ params[-2] + params[-1]
                loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(y, logits))
            for param, grad in zip(params, tape.gradient(loss, params)):
                param.assign_sub(LR * grad)
            return loss

        @tf.function
        def step_fn(iterator):
            loss = tf.constant(0.0)
            for _ in tf.range(per_function):
                x, y = next(iterator)
                loss = strategy.run(replica_fn, args=(x, y))
            return loss

        iterator = iter(coordinator.create_per_worker_dataset(dataset_fn))
        return scheduled_rates(
            coordinator, step_fn, iterator, workers, steps, repeats, per_function
        )
    finally:
        for task in tasks:
            if task.pid is not None:
                task.terminate()
        for task in tasks:
            if task.pid is not None:
                task.join(timeout=10)
                if task.is_alive():
                    task.kill()


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=200, help="steps per timing, all workers")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--steps-per-function", type=int, default=1)
    args = parser.parse_args()
    code = 0
    try:
        rates = tf_rates(args.steps, args.repeats, args.workers, args.steps_per_function)
        rate = statistics.median(rates)
        print(
            f"tf_parameter_server: TF ClusterCoordinator {rate:.0f} steps/s [cpu, MLP "
            f"784-512-512-10, SGD, {args.workers} workers + 1 ps, per-worker batch {BATCH}, "
            f"median of {args.repeats} x {args.steps} steps]",
            flush=True,
        )
    except BaseException:
        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    # TF's coordinator keeps threads that do not end on their own (the task processes are
    # already gone: tf_rates ends them in its finally).
    os._exit(code)


if __name__ == "__main__":
    main()
