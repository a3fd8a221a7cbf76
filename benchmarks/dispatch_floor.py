"""What one call a step costs: the hand-written data-parallel step, one batch a call vs ``k``.

``benchmarks/fit.py`` compares ``MirroredStrategy`` ``fit`` with a hand-written
``jax.jit(jax.shard_map(...))`` loop that calls its compiled step once a batch.
That loop is the floor of one call a step: here the same step runs, in one
invocation on the same devices and batches, once a batch and as a ``lax.scan``
over ``k`` stacked batches a call (what ``steps_per_execution=k`` does for
``fit``). Both wait for each call before the next on CPU, as keras_dist must
there (docs/architecture.md, "A jaxlib hazard").

    python benchmarks/dispatch_floor.py [--devices 4] [--steps-per-call 10]

Prints one line: both rates and their ratio (median of the rounds' ratios).
"""

import argparse
import os
import statistics

from _platform import simulate_cpu_devices
from _timing import steps_per_second

parser = argparse.ArgumentParser(description=__doc__)
parser.add_argument("--devices", type=int, default=4)
parser.add_argument("--batch", type=int, default=256, help="global batch size")
parser.add_argument("--steps", type=int, default=100, help="steps per timing")
parser.add_argument("--steps-per-call", type=int, default=10)
parser.add_argument("--repeats", type=int, default=5)
args = parser.parse_args()
simulate_cpu_devices(args.devices)
os.environ.setdefault("KERAS_BACKEND", "jax")

import jax  # noqa: E402
import numpy as np  # noqa: E402
from _jit_baseline import mlp_train_step  # noqa: E402
from _jit_baseline import run_steps  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

FEATURES, HIDDEN, CLASSES = 128, 512, 10  # fit.py's MLP


def loop(mesh, x, y, steps_per_call):
    """A run of ``args.steps`` steps, ``steps_per_call`` batches a compiled call."""
    rng = np.random.default_rng(0)
    shapes = [(FEATURES, HIDDEN), (HIDDEN,), (HIDDEN, HIDDEN), (HIDDEN,), (HIDDEN, CLASSES)]
    shapes.append((CLASSES,))
    replicated = NamedSharding(mesh, P())
    split = NamedSharding(mesh, P("replica") if steps_per_call == 1 else P(None, "replica"))
    state = {
        "params": [jax.device_put(rng.normal(size=s).astype("float32") * 0.05, replicated)
                   for s in shapes],
        "velocity": [jax.device_put(np.zeros(s, "float32"), replicated) for s in shapes],
    }  # fmt: skip
    compiled = mlp_train_step(mesh, args.batch, 0.01, 0.9, steps_per_call)
    serialize = len(mesh.devices.flat) > 1 and jax.devices()[0].platform == "cpu"
    rows, shape = args.batch * steps_per_call, (steps_per_call, args.batch)
    if steps_per_call == 1:
        shape = (args.batch,)

    def run():
        batches = (
            (x[i : i + rows].reshape(*shape, FEATURES), y[i : i + rows].reshape(shape))
            for i in range(0, len(x), rows)
        )
        run_steps(compiled, state, batches, split, serialize)

    return run


def main():
    k = args.steps_per_call
    steps = args.steps // k * k
    rng = np.random.default_rng(1)
    x = rng.normal(size=(args.batch * steps, FEATURES)).astype("float32")
    y = rng.integers(0, CLASSES, args.batch * steps).astype("int32")
    mesh = jax.sharding.Mesh(np.array(jax.devices()[: args.devices]), ("replica",))
    one, many = loop(mesh, x, y, 1), loop(mesh, x, y, k)
    one(), many()  # compile
    ones, manys = [], []
    for _ in range(args.repeats):
        ones.append(steps_per_second(one, steps))
        manys.append(steps_per_second(many, steps))
    ratio = statistics.median(m / o for m, o in zip(manys, ones))
    print(
        f"dispatch_floor: hand-written jax.jit step {statistics.median(manys):.0f} steps/s "
        f"with {k} steps a call (lax.scan) vs {statistics.median(ones):.0f} steps/s with one, "
        f"ratio {ratio:.2f} [{len(mesh.devices.flat)} x {jax.devices()[0].platform}, MLP "
        f"{FEATURES}-{HIDDEN}-{HIDDEN}-{CLASSES}, global batch {args.batch}, {steps} steps, "
        f"median of {args.repeats}]"
    )


if __name__ == "__main__":
    main()
