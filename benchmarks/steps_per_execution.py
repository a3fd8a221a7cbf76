"""``fit`` with ``steps_per_execution``: its steps as one loop against one call each.

keras_dist runs an execution's steps as one ``lax.scan``, except for a model
with convolutions on CPU, whose steps run one call each
(``keras_dist/_keras_steps/_fused_steps.py``). In one invocation, on the same
devices, this times both forms for the same model (MirroredStrategy over every
local device; 2 simulated devices on CPU): the first ``fit`` call (its compile
and one epoch) and the steps a second after it, and the steps a second of the
same model with ``steps_per_execution=1``.

    python benchmarks/steps_per_execution.py [--steps-per-execution 50] [--model cnn]

Prints one line: first call and steps/s of each form, and their ratios.
"""

import argparse
import os
import statistics
import time

from _platform import simulate_cpu_devices

parser = argparse.ArgumentParser(description=__doc__)
parser.add_argument("--steps-per-execution", type=int, default=50)
parser.add_argument("--model", choices=["cnn", "mlp"], default="cnn")
parser.add_argument("--batch", type=int, default=64, help="global batch size")
parser.add_argument("--repeats", type=int, default=3)
args = parser.parse_args()
simulate_cpu_devices(2)
os.environ.setdefault("KERAS_BACKEND", "jax")

import jax  # noqa: E402
import keras  # noqa: E402
import numpy as np  # noqa: E402
from _image_models import image_classifier  # noqa: E402

import keras_dist as kd  # noqa: E402

# The benchmark's switch between the two forms (a test asks for the loop the same way).
from keras_dist._keras_steps import _steps  # noqa: E402


def build(strategy, steps_per_execution):
    keras.utils.set_random_seed(0)
    with strategy.scope():
        model = image_classifier(args.model)
        model.compile(
            keras.optimizers.SGD(0.01, momentum=0.9),
            keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            steps_per_execution=steps_per_execution,
        )
    return model


def main():
    steps = args.steps_per_execution
    rng = np.random.default_rng(0)
    x = rng.random((args.batch * steps, 32, 32, 3), dtype=np.float32)
    y = rng.integers(0, 10, args.batch * steps)
    strategy = kd.MirroredStrategy()

    def fit(model):
        start = time.perf_counter()
        model.fit(x, y, batch_size=args.batch, epochs=1, shuffle=False, verbose=0)
        return time.perf_counter() - start

    compile_s, rates, models = {}, {}, {}
    for form in ("loop", "apart", "one step"):
        _steps.steps_fuse = lambda devices, model, data, form=form: form == "loop"
        models[form] = build(strategy, 1 if form == "one step" else steps)
        compile_s[form] = fit(models[form])  # the first call compiles
        rates[form] = []
    for _ in range(args.repeats):
        for form, model in models.items():
            rates[form].append(steps / fit(model))
    rate = {form: statistics.median(r) for form, r in rates.items()}
    print(
        f"steps_per_execution={steps}: one loop's first call (compile, one epoch) "
        f"{compile_s['loop']:.2f} s vs a call a step {compile_s['apart']:.2f} s; runs "
        f"{rate['loop']:.0f} vs {rate['apart']:.0f} steps/s (ratio "
        f"{rate['loop'] / rate['apart']:.2f}); steps_per_execution=1 {rate['one step']:.0f} "
        "steps/s "
        f"[{strategy.num_replicas_in_sync} x "
        f"{jax.devices()[0].platform}, {args.model}, global batch {args.batch}, "
        f"median of {args.repeats}]"
    )


if __name__ == "__main__":
    main()
