"""Host time of one compiled training step: a ``@kd.function`` call against Keras's own jit step.

On a GPU a small step is as long as the host's work to start it: what this measures.
Both run the same Keras MLP (``--depth`` hidden Dense(8) layers, SGD with momentum, batch
16, so the device's work is negligible) on one device, alternating in one process:

(a) keras_dist: ``OneDeviceStrategy``, the custom-loop example's step (``strategy.run`` +
    ``strategy.reduce``) in one ``@kd.function`` over a distributed dataset's batches
    (with ``--eager``, the two called as they are, without ``@kd.function``);
(b) Keras's guide loop: ``stateless_call`` and ``optimizer.stateless_apply`` in one
    ``jax.jit`` (donating its state), on batches already on the device.

It reports the main thread's CPU time per call (``time.thread_time``: the work of other
processes on a shared machine does not count), and of it the time keras_dist spends outside
JAX's call of its compiled program (keras_dist's own Python: reading and writing back the
variables, checking and placing the arguments, rebuilding the results).

    python benchmarks/host_cost.py [--depth 1] [--calls 1000] [--repeats 9] [--eager]

Prints one line: both calls' host time and their ratio (medians of the repeats).
"""

import argparse
import os
import statistics
import sys
import time

parser = argparse.ArgumentParser(description=__doc__)
parser.add_argument("--depth", type=int, default=1, help="hidden layers (2 variables each)")
parser.add_argument("--calls", type=int, default=1000, help="calls per timed repeat")
parser.add_argument("--repeats", type=int, default=9)
parser.add_argument("--eager", action="store_true", help="strategy.run without @kd.function")
args = parser.parse_args()
os.environ.setdefault("KERAS_BACKEND", "jax")
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "examples"))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import keras  # noqa: E402
import numpy as np  # noqa: E402
from custom_training_loop import make_train_step  # noqa: E402 - the example's step
from jax._src import stages  # noqa: E402 - to time JAX's call of a compiled program

import keras_dist as kd  # noqa: E402

BATCH = 16


def build_model():
    hidden = [keras.layers.Dense(8, activation="relu") for _ in range(args.depth)]
    return keras.Sequential([keras.Input((8,)), *hidden, keras.layers.Dense(4)])


def batches():
    rng = np.random.default_rng(0)
    return [
        (rng.normal(size=(BATCH, 8)).astype("float32"), rng.integers(0, 4, BATCH).astype("int32"))
        for _ in range(8)
    ]


def keras_dist_step():
    strategy = kd.OneDeviceStrategy(jax.devices()[0])
    with strategy.scope():
        model = build_model()
        optimizer = keras.optimizers.SGD(0.05, momentum=0.9)
    train_step = make_train_step(model, optimizer, global_batch_size=BATCH)

    def step(batch):
        return strategy.reduce("SUM", strategy.run(train_step, args=(batch,)), None)

    if not args.eager:
        step = kd.function(step)

    dataset = list(strategy.experimental_distribute_dataset(batches()))

    def run(calls):
        for i in range(calls):
            loss = step(dataset[i % len(dataset)])
        jax.block_until_ready(loss)

    return run


def keras_jit_step():
    model = build_model()
    optimizer = keras.optimizers.SGD(0.05, momentum=0.9)
    optimizer.build(model.trainable_variables)
    loss_object = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction="none")

    def step(state, x, y):
        trainable, non_trainable, slots = state

        def loss_fn(trainable, non_trainable):
            logits, non_trainable = model.stateless_call(trainable, non_trainable, x, training=True)
            return jnp.sum(loss_object(y, logits)) / BATCH, non_trainable

        (loss, non_trainable), grads = jax.value_and_grad(loss_fn, has_aux=True)(
            trainable, non_trainable
        )
        trainable, slots = optimizer.stateless_apply(slots, grads, trainable)
        return (trainable, non_trainable, slots), loss

    compiled = jax.jit(step, donate_argnums=0)
    state = {
        "state": (
            [v.value for v in model.trainable_variables],
            [v.value for v in model.non_trainable_variables],
            [v.value for v in optimizer.variables],
        )
    }
    data = [(jax.device_put(x), jax.device_put(y)) for x, y in batches()]

    def run(calls):
        for i in range(calls):
            state["state"], loss = compiled(state["state"], *data[i % len(data)])
        jax.block_until_ready(loss)

    return run


class CompiledCallTime:
    """The main thread's CPU time inside JAX's calls of compiled programs, while active."""

    def __init__(self):
        self.seconds = 0.0
        self._call = stages.Compiled.__call__

    def __enter__(self):
        call = self._call

        def timed(compiled, *a, **k):
            began = time.thread_time()
            try:
                return call(compiled, *a, **k)
            finally:
                self.seconds += time.thread_time() - began

        stages.Compiled.__call__ = timed
        return self

    def __exit__(self, *exc_info):
        stages.Compiled.__call__ = self._call


def host_time(run, calls):
    """µs of the main thread's CPU time per call."""
    began = time.thread_time()
    run(calls)
    return (time.thread_time() - began) / calls * 1e6


def main():
    ours, theirs = keras_dist_step(), keras_jit_step()
    for run in (ours, theirs):
        run(50)  # compile
    totals, own, plain = [], [], []
    for _ in range(args.repeats):
        with CompiledCallTime() as compiled:
            totals.append(host_time(ours, args.calls))
        own.append(totals[-1] - compiled.seconds / args.calls * 1e6)
        plain.append(host_time(theirs, args.calls))
    ratios = [p / t for p, t in zip(plain, totals)]
    device = jax.devices()[0]
    ours_name = "strategy.run" if args.eager else "@kd.function"
    print(
        f"host_cost: keras_dist {ours_name} {statistics.median(totals):.1f} µs a call (its "
        f"own Python {statistics.median(own):.1f} µs) vs Keras's own jit step "
        f"{statistics.median(plain):.1f} µs, ratio {statistics.median(ratios):.2f} "
        f"[1 x {device.platform}, MLP of {args.depth} hidden layers, "
        f"{2 * args.depth + 2} variables, main thread's CPU time, median of "
        f"{args.repeats} x {args.calls} calls]"
    )


if __name__ == "__main__":
    main()
