"""Train the digit classifier on several processes with MultiWorkerMirroredStrategy.

The tf.distribute multi-worker recipe with ``keras_dist``: every worker runs this
same script; ``TF_CONFIG`` (or a Kubeflow / Slurm environment) tells each one its
task. The strategy is created first, before anything uses JAX. Only the chief
writes the checkpoint and the TensorBoard logs; ``BackupAndRestore`` lets a
relaunched job resume where it stopped.

    keras-dist launch --workers 2 examples/multi_worker_fit.py --epochs 5

(``keras-dist launch`` starts the workers on this machine with ``TF_CONFIG`` and
free ports; add ``--max-restarts 1`` to relaunch after a lost worker.)
"""

import argparse
import os

os.environ.setdefault("KERAS_BACKEND", "jax")

import keras_dist as kd  # noqa: E402

# First: it starts JAX's multi-process runtime from TF_CONFIG.
strategy = kd.MultiWorkerMirroredStrategy()

import keras  # noqa: E402
from sklearn.datasets import load_digits  # noqa: E402
from sklearn.model_selection import train_test_split  # noqa: E402


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--batch-size", type=int, default=64, help="global batch size")
    parser.add_argument("--output", default="multi_worker_output", help="checkpoints and logs")
    args = parser.parse_args()

    resolver = strategy.cluster_resolver
    task = f"{resolver.task_type} {resolver.task_id}"
    print(f"{task}: {strategy.num_replicas_in_sync} replicas in sync")
    keras.utils.set_random_seed(0)
    digits = load_digits()
    x = (digits.data / 16.0).astype("float32")
    y = digits.target.astype("int32")
    # Every worker passes the same data: each global batch is split between them.
    x_train, x_test, y_train, y_test = train_test_split(
        x, y, test_size=0.2, random_state=0, stratify=y
    )
    with strategy.scope():
        model = keras.Sequential(
            [
                keras.Input((64,)),
                keras.layers.Dense(128, activation="relu"),
                keras.layers.Dense(10, activation="softmax"),
            ]
        )
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
        verbose=0,
        callbacks=[
            kd.callbacks.BackupAndRestore(os.path.join(args.output, "backup")),
            kd.callbacks.ModelCheckpoint(os.path.join(args.output, "model.keras")),
            kd.callbacks.TensorBoard(os.path.join(args.output, "logs")),
        ],
    )
    loss, accuracy = model.evaluate(x_test, y_test, batch_size=args.batch_size, verbose=0)
    print(f"{task}: test loss {loss:.4f}, final test accuracy: {accuracy:.4f}")


if __name__ == "__main__":
    main()
