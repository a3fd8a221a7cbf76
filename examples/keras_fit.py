"""Train a digit classifier with ``model.fit`` under MirroredStrategy.

The tf.distribute guide's recipe, with ``keras_dist`` in place of
``tf.distribute``: create and compile the model in ``strategy.scope()``, then
call ``fit``, ``evaluate`` and ``predict`` as usual. The data is
scikit-learn's 8x8 digits (shipped with the package). Without accelerators the
script simulates 4 CPU devices.

    python examples/keras_fit.py --epochs 10
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


def build_model():
    return keras.Sequential(
        [
            keras.Input((64,)),
            keras.layers.Dense(128, activation="relu"),
            keras.layers.BatchNormalization(),
            keras.layers.Dense(128, activation="relu"),
            keras.layers.Dropout(0.1),
            keras.layers.Dense(10, activation="softmax"),
        ]
    )


class PrintAccuracy(keras.callbacks.Callback):
    def on_epoch_end(self, epoch, logs=None):
        print(
            f"epoch {epoch + 1:2d}  loss {logs['loss']:.4f}  accuracy {logs['accuracy']:.4f}  "
            f"val_loss {logs['val_loss']:.4f}  val_accuracy {logs['val_accuracy']:.4f}"
        )


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--batch-size", type=int, default=64, help="global batch size")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    keras.utils.set_random_seed(args.seed)
    digits = load_digits()
    x = (digits.data / 16.0).astype("float32")
    y = digits.target.astype("int32")
    x_train, x_test, y_train, y_test = train_test_split(
        x, y, test_size=0.2, random_state=args.seed, stratify=y
    )

    strategy = kd.MirroredStrategy()
    print(f"{strategy.num_replicas_in_sync} replicas on {list(strategy.extended.worker_devices)}")
    with strategy.scope():
        model = build_model()
        model.compile(
            optimizer=keras.optimizers.Adam(1e-3),
            loss="sparse_categorical_crossentropy",
            metrics=["accuracy"],
        )

    model.fit(
        x_train,
        y_train,
        epochs=args.epochs,
        batch_size=args.batch_size,
        validation_data=(x_test, y_test),
        callbacks=[PrintAccuracy()],
        verbose=0,
    )
    loss, accuracy = model.evaluate(x_test, y_test, batch_size=args.batch_size, verbose=0)
    predictions = model.predict(x_test, batch_size=args.batch_size, verbose=0)
    agreement = float(np.mean(np.argmax(predictions, axis=-1) == y_test))
    print(f"test loss {loss:.4f}, predict() accuracy {agreement:.4f}")
    print(f"final test accuracy: {accuracy:.4f}")
    return accuracy


if __name__ == "__main__":
    main()
