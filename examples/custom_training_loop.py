"""Train a digit classifier with MirroredStrategy and a tf.distribute-style custom loop.

The data is scikit-learn's 8x8 digits (shipped with the package). On a machine
without accelerators the script simulates 4 CPU devices, so the replicas,
the per-replica losses and the fused all-reduce of gradients are real.

    python examples/custom_training_loop.py --epochs 15
"""

import argparse
import os

# Simulated CPU devices must be requested before JAX starts its CPU backend, and
# Keras reads its backend when first imported.
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=4")
os.environ.setdefault("KERAS_BACKEND", "jax")

import keras  # noqa: E402
import numpy as np  # noqa: E402
from sklearn.datasets import load_digits  # noqa: E402
from sklearn.model_selection import train_test_split  # noqa: E402

import keras_dist as kd  # noqa: E402

GLOBAL_BATCH_SIZE = 64


def load_data(seed: int):
    digits = load_digits()
    x = (digits.data / 16.0).astype("float32")
    y = digits.target.astype("int32")
    return train_test_split(x, y, test_size=0.2, random_state=seed, stratify=y)


class ShuffledBatches:
    """Global batches of (x, y), reshuffled every epoch (re-iterable, like a tf.data pipeline)."""

    def __init__(self, x, y, batch_size, seed=None):
        self.x, self.y, self.batch_size = x, y, batch_size
        self.rng = np.random.default_rng(seed) if seed is not None else None

    def __iter__(self):
        order = np.arange(len(self.x))
        if self.rng is not None:
            order = self.rng.permutation(order)
        for start in range(0, len(order), self.batch_size):
            index = order[start : start + self.batch_size]
            yield self.x[index], self.y[index]


def build_model():
    return keras.Sequential(
        [
            keras.Input((64,)),
            keras.layers.Dense(128, activation="relu"),
            keras.layers.Dense(128, activation="relu"),
            keras.layers.Dense(10),
        ]
    )


def make_train_step(model, optimizer, global_batch_size=GLOBAL_BATCH_SIZE):
    loss_object = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction=None)

    def train_step(inputs):
        x, y = inputs

        def loss_fn():
            per_example_loss = loss_object(y, model(x, training=True))
            return kd.nn.compute_average_loss(per_example_loss, global_batch_size=global_batch_size)

        loss, grads = kd.value_and_grad(loss_fn, model.trainable_variables)()
        optimizer.apply_gradients(zip(grads, model.trainable_variables))
        return loss

    return train_step


def make_eval_step(model):
    def eval_step(inputs):
        x, y = inputs
        predictions = keras.ops.argmax(model(x, training=False), axis=-1)
        return keras.ops.sum(keras.ops.cast(predictions == y, "float32"))

    return eval_step


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--epochs", type=int, default=15)
    parser.add_argument("--learning-rate", type=float, default=0.05)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    keras.utils.set_random_seed(args.seed)
    x_train, x_test, y_train, y_test = load_data(args.seed)
    strategy = kd.MirroredStrategy()
    print(f"{strategy.num_replicas_in_sync} replicas on {list(strategy.extended.worker_devices)}")

    with strategy.scope():
        model = build_model()
        optimizer = keras.optimizers.SGD(args.learning_rate, momentum=0.9)

    train_step = make_train_step(model, optimizer)
    eval_step = make_eval_step(model)
    train_data = strategy.experimental_distribute_dataset(
        ShuffledBatches(x_train, y_train, GLOBAL_BATCH_SIZE, seed=args.seed)
    )
    test_data = strategy.experimental_distribute_dataset(
        ShuffledBatches(x_test, y_test, GLOBAL_BATCH_SIZE)
    )

    def accuracy(dataset, size):
        correct = 0.0
        for batch in dataset:
            correct += float(strategy.reduce("SUM", strategy.run(eval_step, args=(batch,)), None))
        return correct / size

    for epoch in range(1, args.epochs + 1):
        total_loss, steps = 0.0, 0
        for batch in train_data:
            per_replica_loss = strategy.run(train_step, args=(batch,))
            total_loss += float(strategy.reduce("SUM", per_replica_loss, axis=None))
            steps += 1
        print(
            f"epoch {epoch:2d}  loss {total_loss / steps:.4f}  "
            f"train accuracy {accuracy(train_data, len(x_train)):.4f}  "
            f"test accuracy {accuracy(test_data, len(x_test)):.4f}"
        )
    final = accuracy(test_data, len(x_test))
    print(f"final test accuracy: {final:.4f}")
    return final


if __name__ == "__main__":
    main()
