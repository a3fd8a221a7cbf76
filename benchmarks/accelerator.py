"""keras_dist on whatever devices this machine has, against plain Keras and JAX on the same devices.

On a GPU or TPU machine the devices are the accelerators (no CPU-only flag is
set); elsewhere 8 simulated CPU devices. In one invocation:

* ``fit``: ``MirroredStrategy`` fit of an MLP against plain Keras fit on the same
  devices (``keras.distribution.DataParallel`` when there are several);
* the custom loop: a ``@kd.function`` step around ``strategy.run`` against a
  hand-written ``jax.jit(jax.shard_map(...))`` step with a ``psum``;
* all-reduce: ``ReplicaContext.all_reduce`` inside ``@kd.function`` against a
  hand-written ``psum``, as bus bandwidth (algbw x 2(n-1)/n, as nccl-tests
  reports it; zero on one device, where nothing moves);
* a ResNet-ish CNN and a small Transformer: ``MirroredStrategy`` fit step time
  against plain Keras fit on the same devices.

    python benchmarks/accelerator.py [--size small|large] [--policy mixed_bfloat16]

``--size`` defaults to ``large`` on accelerators and ``small`` on CPUs. Each
line gives keras_dist's rate, the baseline's, and their ratio (median of the
repeats, higher is better for keras_dist), with the platform and device count.
"""

import argparse
import statistics

from _platform import has_accelerator
from _platform import simulate_cpu_devices
from _timing import steps_per_second

parser = argparse.ArgumentParser(description=__doc__)
parser.add_argument("--size", choices=("small", "large"), default=None)
parser.add_argument("--policy", default="float32", help="Keras dtype policy of the models")
parser.add_argument("--repeats", type=int, default=5)
args = parser.parse_args()
simulate_cpu_devices(8)
LARGE = (args.size or ("large" if has_accelerator() else "small")) == "large"

import os  # noqa: E402

os.environ.setdefault("KERAS_BACKEND", "jax")

import jax  # noqa: E402
import keras  # noqa: E402
import numpy as np  # noqa: E402
from _jit_baseline import keras_mlp  # noqa: E402
from _jit_baseline import mlp_train_step  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import keras_dist as kd  # noqa: E402

DEVICES = jax.devices()
PLATFORM = f"{len(DEVICES)} x {DEVICES[0].platform} ({DEVICES[0].device_kind})"
SERIALIZE = len(DEVICES) > 1 and DEVICES[0].platform == "cpu"  # as keras_dist does on CPU


def median_ratio(ours, baseline, unit_steps):
    """Alternates ``ours()`` and ``baseline()``; medians of their rates and of the paired ratios."""
    ours()
    baseline()  # compile and warm up
    rates, ratios = ([], []), []
    for _ in range(args.repeats):
        a, b = steps_per_second(ours, unit_steps), steps_per_second(baseline, unit_steps)
        rates[0].append(a)
        rates[1].append(b)
        ratios.append(a / b)
    return statistics.median(rates[0]), statistics.median(rates[1]), statistics.median(ratios)


def fit_runner(build, x, y, batch, strategy):
    """A runner of one epoch of ``fit``: under ``strategy``, or plain Keras on the same devices."""
    if strategy is not None:
        scope = strategy.scope()
    elif len(DEVICES) > 1:
        scope = keras.distribution.DataParallel(devices=DEVICES).scope()
    else:
        scope = _nothing()
    with scope:
        model = build()

        def run():
            model.fit(x, y, batch_size=batch, epochs=1, shuffle=False, verbose=0)

    return run


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def compare_fit(name, build, x, y, batch):
    steps = len(x) // batch
    ours = fit_runner(build, x, y, batch, kd.MirroredStrategy())
    plain = fit_runner(build, x, y, batch, None)
    a, b, ratio = median_ratio(ours, plain, steps)
    baseline = "keras DataParallel" if len(DEVICES) > 1 else "plain Keras"
    print(
        f"accelerator {name}: MirroredStrategy fit {1e3 / a:.2f} ms/step vs {baseline} fit "
        f"{1e3 / b:.2f} ms/step, ratio {ratio:.2f} [{PLATFORM}, global batch {batch}, "
        f"policy {args.policy}, median of {args.repeats}]",
        flush=True,
    )


def mlp(features, hidden):
    return lambda: keras_mlp(features, hidden, 10, learning_rate=0.01, momentum=0.9)


def resnet_ish(width):
    """A small ResNet for 32x32x3 images: a stem and three stages of two residual blocks."""

    def block(h, filters, stride):
        shortcut = h
        h = keras.layers.Conv2D(filters, 3, stride, padding="same", use_bias=False)(h)
        h = keras.layers.ReLU()(keras.layers.BatchNormalization()(h))
        h = keras.layers.Conv2D(filters, 3, padding="same", use_bias=False)(h)
        h = keras.layers.BatchNormalization()(h)
        if stride != 1 or shortcut.shape[-1] != filters:
            shortcut = keras.layers.Conv2D(filters, 1, stride, use_bias=False)(shortcut)
        return keras.layers.ReLU()(h + shortcut)

    def build():
        keras.utils.set_random_seed(0)
        inputs = keras.Input((32, 32, 3))
        h = keras.layers.Conv2D(width, 3, padding="same", activation="relu")(inputs)
        for stage, filters in enumerate((width, 2 * width, 4 * width)):
            h = block(h, filters, 1 if stage == 0 else 2)
            h = block(h, filters, 1)
        outputs = keras.layers.Dense(10)(keras.layers.GlobalAveragePooling2D()(h))
        return _compiled(keras.Model(inputs, outputs))

    return build


def transformer(vocab, length, dim, heads, layers):
    """A small encoder for sequence classification: embeddings, attention blocks, mean pooling."""

    def build():
        keras.utils.set_random_seed(0)
        tokens = keras.Input((length,), dtype="int32")
        h = keras.layers.Embedding(vocab, dim)(tokens)
        h = h + keras.layers.Embedding(length, dim)(keras.ops.arange(length))
        for _ in range(layers):
            attended = keras.layers.MultiHeadAttention(heads, dim // heads)(h, h)
            h = keras.layers.LayerNormalization()(h + attended)
            hidden = keras.layers.Dense(4 * dim, activation="gelu")(h)
            h = keras.layers.LayerNormalization()(h + keras.layers.Dense(dim)(hidden))
        outputs = keras.layers.Dense(10)(keras.layers.GlobalAveragePooling1D()(h))
        return _compiled(keras.Model(tokens, outputs))

    return build


def _compiled(model):
    model.compile(
        optimizer=keras.optimizers.Adam(1e-3),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    return model


def compare_custom_loop(features, hidden, batch, steps):
    strategy = kd.MirroredStrategy()
    with strategy.scope():
        model = keras_mlp(features, hidden, 10, learning_rate=0.01, momentum=0.9)
    loss_object = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction=None)

    def replica_step(x, y):
        def loss_fn():
            return kd.nn.compute_average_loss(loss_object(y, model(x, training=True)), batch)

        loss, grads = kd.value_and_grad(loss_fn, model.trainable_variables)()
        model.optimizer.apply_gradients(zip(grads, model.trainable_variables))
        return loss

    @kd.function
    def step(x, y):
        return strategy.reduce("SUM", strategy.run(replica_step, args=(x, y)), axis=None)

    rng = np.random.default_rng(0)
    x = rng.normal(size=(batch, features)).astype("float32")
    y = rng.integers(0, 10, batch).astype("int32")
    (batch_x, batch_y) = next(iter(strategy.experimental_distribute_dataset([(x, y)])))

    def ours():
        loss = None
        for _ in range(steps):
            loss = step(batch_x, batch_y)
        jax.block_until_ready(loss)

    mesh = jax.sharding.Mesh(np.array(DEVICES), ("replica",))
    replicated, split = NamedSharding(mesh, P()), NamedSharding(mesh, P("replica"))
    state = {
        "params": [jax.device_put(w.numpy(), replicated) for w in model.trainable_variables],
        "velocity": [
            jax.device_put(np.zeros(w.shape, "float32"), replicated)
            for w in model.trainable_variables
        ],
    }
    jit_step = mlp_train_step(mesh, batch, 0.01, 0.9)
    xs, ys = jax.device_put(x, split), jax.device_put(y, split)

    def baseline():
        loss = None
        for _ in range(steps):
            if loss is not None and SERIALIZE:
                loss.block_until_ready()
            state["params"], state["velocity"], loss = jit_step(
                state["params"], state["velocity"], xs, ys
            )
        jax.block_until_ready(loss)

    a, b, ratio = median_ratio(ours, baseline, steps)
    print(
        f"accelerator custom loop: @kd.function strategy.run {1e3 / a:.2f} ms/step vs "
        f"hand-written jax.jit (float32) {1e3 / b:.2f} ms/step, ratio {ratio:.2f} "
        f"[{PLATFORM}, MLP {features}-{hidden}-{hidden}-10, global batch {batch}, "
        f"median of {args.repeats}]",
        flush=True,
    )


def compare_all_reduce(megabytes, calls):
    strategy = kd.MirroredStrategy()
    n = strategy.num_replicas_in_sync
    elements = int(megabytes * 2**20) // 4
    rows = np.ones((n, elements), "float32")
    per_replica = strategy.experimental_distribute_values_from_function(
        lambda context: rows[context.replica_id_in_sync_group]
    )

    @kd.function
    def all_reduce(values):
        return strategy.run(lambda v: kd.get_replica_context().all_reduce("SUM", v), args=(values,))

    def ours():
        out = None
        for _ in range(calls):
            out = all_reduce(per_replica)
        jax.block_until_ready(strategy.experimental_local_results(out))

    mesh = jax.sharding.Mesh(np.array(DEVICES), ("replica",))
    psum = jax.jit(
        jax.shard_map(
            lambda v: jax.lax.psum(v, "replica"),
            mesh=mesh,
            in_specs=P("replica"),
            out_specs=P("replica"),
        )
    )
    stacked = jax.device_put(rows, NamedSharding(mesh, P("replica")))

    def baseline():
        out = None
        for _ in range(calls):
            if out is not None and SERIALIZE:
                out.block_until_ready()
            out = psum(stacked)
        jax.block_until_ready(out)

    a, b, ratio = median_ratio(ours, baseline, calls)
    size = elements * 4

    def bus_bandwidth(calls_per_second):
        return size * calls_per_second * 2 * (n - 1) / n / 1e9

    print(
        f"accelerator all_reduce {size / 2**20:.0f} MiB: kd all_reduce {1e6 / a:.0f} µs "
        f"(busbw {bus_bandwidth(a):.1f} GB/s) vs psum {1e6 / b:.0f} µs "
        f"(busbw {bus_bandwidth(b):.1f} GB/s), ratio {ratio:.2f} [{PLATFORM}, "
        f"median of {args.repeats} x {calls} calls]",
        flush=True,
    )


def main():
    keras.config.set_dtype_policy(args.policy)
    rng = np.random.default_rng(0)
    n = len(DEVICES)
    print(f"accelerator: {PLATFORM}, size {'large' if LARGE else 'small'}", flush=True)

    features, hidden, batch = (1024, 4096, 1024) if LARGE else (256, 512, 256)
    rows = batch * (50 if LARGE else 10)
    x = rng.normal(size=(rows, features)).astype("float32")
    y = rng.integers(0, 10, rows).astype("int32")
    compare_fit("MLP", mlp(features, hidden), x, y, batch)
    compare_custom_loop(features, hidden, batch, steps=50 if LARGE else 10)
    for megabytes in (1, 64, 256) if LARGE else (1, 16):
        compare_all_reduce(megabytes, calls=20 if LARGE else 5)

    width, batch = (64, 256) if LARGE else (8, 32 * n)
    rows = batch * (20 if LARGE else 4)
    images = rng.normal(size=(rows, 32, 32, 3)).astype("float32")
    labels = rng.integers(0, 10, rows).astype("int32")
    compare_fit("ResNet-ish CNN", resnet_ish(width), images, labels, batch)

    vocab, length, dim, heads, layers, batch = (
        (8192, 256, 512, 8, 4, 64) if LARGE else (1000, 32, 64, 4, 2, 4 * n)
    )
    rows = batch * (20 if LARGE else 4)
    tokens = rng.integers(0, vocab, (rows, length)).astype("int32")
    labels = rng.integers(0, 10, rows).astype("int32")
    encoder = transformer(vocab, length, dim, heads, layers)
    compare_fit("Transformer", encoder, tokens, labels, batch)


if __name__ == "__main__":
    main()
