"""What an elastic job resumed on 2 of its 3 workers must end with: one device's numbers.

Shared by the elastic tests (``tests/multiprocess/test_elastic_launch.py``: a worker's
process gone; ``tests/hosts/test_elastic_host_loss.py``: a host's link cut). Their
workers fit ``small_model()`` on ``regression_data()`` for ``EPOCHS`` epochs of global
batches of ``BATCH`` with ``BackupAndRestore``; worker 0 saves its first weights
(``initial.npy``).
"""

import sys

import cloudpickle
import numpy as np

EPOCHS, ROWS, BATCH = 4, 96, 12  # 8 steps an epoch
# The workers call ``small_model`` and ``regression_data`` too, and cannot import this
# file: it is sent by value.
cloudpickle.register_pickle_by_value(sys.modules[__name__])


def small_model():
    import keras

    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(4), keras.layers.Dense(1)])
    model.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse")
    return model


def regression_data():
    x = np.random.default_rng(1).normal(size=(ROWS, 3)).astype("float32")
    return x, x @ np.array([[1.0], [-2.0], [0.5]], "float32")


def fit_with_backup(model, directory, callback) -> dict:
    """A worker's ``fit`` of ``regression_data()`` with ``kd.callbacks.BackupAndRestore``
    in ``directory`` and ``callback``; what ``assert_resumed_as_one_device`` reads."""
    import keras_dist as kd

    x, y = regression_data()
    history = model.fit(
        x,
        y,
        batch_size=BATCH,  # the global batch, whatever the number of workers
        epochs=EPOCHS,
        shuffle=False,
        verbose=0,
        callbacks=[kd.callbacks.BackupAndRestore(str(directory) + "/backup"), callback],
    )
    return {
        "iterations": int(model.optimizer.iterations.numpy()),
        "history": history.history,
        "epochs": history.epoch,
        "final": np.concatenate([np.ravel(w) for w in model.get_weights()]),
    }


def assert_resumed_as_one_device(results, directory):
    """``results`` (each worker's ``iterations``, ``epochs``, ``history``, ``final``)
    resumed at epoch 2 on 2 workers and equal one device's fit from ``initial.npy``."""
    reference = small_model()
    assert len(results) == 2  # the job finished on 2 workers
    for result in results:
        assert result["iterations"] == EPOCHS * (ROWS // BATCH)
        # The resumed run did epochs 2 and 3 on 2 workers (epochs 0 and 1 had 3).
        assert result["epochs"] == [2, 3]
        assert result["history"]["workers"] == [2, 2]
    np.testing.assert_array_equal(results[0]["final"], results[1]["final"])
    # One device from the same first weights on the same global batches.
    flat = np.load(directory / "initial.npy")
    shapes = [w.shape for w in reference.get_weights()]
    pieces = np.split(flat, np.cumsum([int(np.prod(s)) for s in shapes])[:-1])
    reference.set_weights([w.reshape(s) for w, s in zip(pieces, shapes)])
    x, y = regression_data()
    history = reference.fit(x, y, batch_size=BATCH, epochs=EPOCHS, shuffle=False, verbose=0)
    expected = np.concatenate([np.ravel(w) for w in reference.get_weights()])
    np.testing.assert_allclose(results[0]["final"], expected, atol=1e-5)
    # The loss falls to ~3e-5: float32 sums in another order differ by ~1e-9 there.
    np.testing.assert_allclose(
        results[0]["history"]["loss"], history.history["loss"][2:], rtol=1e-5, atol=1e-8
    )
    assert history.history["loss"][-1] < 0.2 * history.history["loss"][0]
