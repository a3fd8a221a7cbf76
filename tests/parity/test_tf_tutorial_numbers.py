"""TF's custom-training tutorial, ported with the README's substitutions, gives TF's losses.

The TF numbers come from TF 2.21 (tensorflow-cpu, Keras 3.15) running the same
program: ``tf.distribute.MirroredStrategy`` on 4 logical CPUs, ``@tf.function``
on the train step, ``GradientTape``, the same data, starting weights and SGD,
no shuffling. 42 rows in global batches of 16: the last batch has 10 rows,
split 3/3/3/1 by TF. (Adam could not be compared: under TF 2.21 with Keras 3,
its update inside ``tf.function`` and MirroredStrategy fails with "You must
feed a value for placeholder tensor 'cond/else/_1/cond/Placeholder_1'".)
"""

import keras
import numpy as np
from conftest import cpus

import keras_dist as kd

# Per-step SUM of the replicas' losses, two epochs, and the accuracy metric after them.
TF_LOSSES = [0.7090446949005127, 0.6724058389663696, 0.42346569895744324,
             0.6868166923522949, 0.6603779792785645, 0.4169138967990875]  # fmt: skip
TF_ACCURACY = 0.5
TF_FIRST_KERNEL_SUM = 0.5023243427276611
GLOBAL_BATCH = 16


def _data():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(42, 6)).astype("float32")
    y = (x[:, 0] - x[:, 3] > 0).astype("int32")
    return x, y


def _starting_weights():
    k1 = (np.sin(np.arange(6 * 12)).reshape(6, 12) * 0.3).astype("float32")
    k2 = (np.cos(np.arange(12 * 2)).reshape(12, 2) * 0.3).astype("float32")
    return [k1, np.zeros(12, "float32"), k2, np.zeros(2, "float32")]


def _ported_tutorial(strategy):
    x, y = _data()
    with strategy.scope():
        model = keras.Sequential(
            [keras.Input((6,)), keras.layers.Dense(12, activation="relu"), keras.layers.Dense(2)]
        )
        model.set_weights(_starting_weights())
        optimizer = keras.optimizers.SGD(0.1)
        accuracy = keras.metrics.SparseCategoricalAccuracy()
    loss_object = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction=None)
    batches = [(x[i : i + GLOBAL_BATCH], y[i : i + GLOBAL_BATCH]) for i in range(0, 42, 16)]
    dataset = strategy.experimental_distribute_dataset(batches)

    @kd.function  # was @tf.function
    def train_step(inputs):
        def step_fn(inputs):  # a new closure on every call, as in the tutorial
            xb, yb = inputs

            def loss_fn():  # was the GradientTape block
                logits = model(xb, training=True)
                per_example = loss_object(yb, logits)
                return kd.nn.compute_average_loss(per_example, global_batch_size=GLOBAL_BATCH), (
                    logits
                )

            (loss, logits), grads = kd.value_and_grad(
                loss_fn, model.trainable_variables, has_aux=True
            )()
            optimizer.apply_gradients(zip(grads, model.trainable_variables))
            accuracy.update_state(yb, logits)
            return loss

        return strategy.reduce("SUM", strategy.run(step_fn, args=(inputs,)), axis=None)

    losses = [float(train_step(inputs)) for _ in range(2) for inputs in dataset]
    return losses, float(accuracy.result()), model, train_step


def test_ported_tutorial_gives_tf_221s_losses_including_the_partial_batch():
    strategy = kd.MirroredStrategy(cpus(4))
    losses, accuracy, model, train_step = _ported_tutorial(strategy)
    np.testing.assert_allclose(losses, TF_LOSSES, atol=1e-5)
    assert accuracy == TF_ACCURACY
    np.testing.assert_allclose(np.sum(model.get_weights()[0]), TF_FIRST_KERNEL_SUM, atol=1e-5)
    # Traced once per input signature: the two full batches share one; the
    # partial batch falls back to Python around a compiled uneven step.
    assert train_step.experimental_get_tracing_count() == 1
    assert strategy.extended._uneven.trace_count == 1
    # And one device gives the same numbers.
    one_device, one_accuracy, _, _ = _ported_tutorial(kd.OneDeviceStrategy("/cpu:0"))
    np.testing.assert_allclose(losses, one_device, atol=1e-5)
    assert one_accuracy == accuracy
