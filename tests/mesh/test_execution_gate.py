"""On several CPU devices a compiled program has ended when the call that ran it returns.

jaxlib 0.10.2 aborted Keras's own early-stopping test under a Mirrored strategy
(XLA's "Termination timeout for `all reduce`"): the metrics were read eagerly
while the step that computed them still ran, and a device's share of the step,
launched late, found its device full of programs waiting on that step. So user
code only ever sees the results of a program that has ended; only a loop that
runs nothing between two steps (Keras's, with quiet callbacks) overlaps them.
"""

import jax
import keras
import numpy as np
import pytest
from conftest import cpus

import keras_dist as kd
from keras_dist._engine._gate import GATE
from keras_dist._keras._callbacks import quiet_between_steps


def _heavy(x):
    # Long enough on the CPU (~ms) that a program still runs when its call returns.
    for _ in range(8):
        x = keras.ops.tanh(keras.ops.matmul(x, x) / 256.0)
    return x


@pytest.mark.parametrize("call", ["run", "function"])
def test_a_step_with_collectives_has_ended_when_its_call_returns(call):
    strategy = kd.MirroredStrategy(cpus(4))
    with strategy.scope():
        w = keras.Variable(np.zeros((256, 256), "float32"))

    def step(x):
        y = kd.get_replica_context().all_reduce("SUM", _heavy(x))
        w.assign(y)
        return y

    x = strategy.experimental_distribute_values_from_function(
        lambda c: np.full((256, 256), 0.01 * (c.replica_id_in_sync_group + 1), "float32")
    )
    run = strategy.run if call == "run" else kd.function(lambda x: strategy.run(step, args=(x,)))
    for _ in range(3):
        out = strategy.run(step, args=(x,)) if call == "run" else run(x)
        results = strategy.experimental_local_results(out)
        assert all(r.is_ready() for r in results)
        assert w.value.is_ready()
    rows = [np.full((256, 256), 0.01 * r, "float32") for r in (1, 2, 3, 4)]
    expected = sum(np.asarray(_heavy(row)) for row in rows)  # one device's sum of the four
    np.testing.assert_allclose(np.asarray(results[0]), expected, rtol=1e-5)


def _model():
    keras.utils.set_random_seed(7)
    model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(512), keras.layers.Dense(1)])
    model.compile(optimizer=keras.optimizers.SGD(0.01), loss="mse", metrics=["mae"])
    return model


def _data():
    rng = np.random.default_rng(0)
    return rng.normal(size=(1024, 64)).astype("float32"), rng.normal(size=(1024, 1)).astype(
        "float32"
    )


class _SeesWeights(keras.callbacks.Callback):
    """Records, at each batch's end, whether the model's weights are computed."""

    def __init__(self):
        super().__init__()
        self.ready = []

    def on_train_batch_end(self, batch, logs=None):
        self.ready.append(all(v.value.is_ready() for v in self.model.trainable_variables))


class _Deferrals:
    def __init__(self, monkeypatch):
        self.count = 0
        original = GATE.deferring

        def deferring():
            self.count += 1
            return original()

        monkeypatch.setattr(GATE, "deferring", deferring)


def test_a_batch_callback_sees_the_weights_of_an_ended_step_and_quiet_fit_gives_the_same(
    monkeypatch,
):
    x, y = _data()
    deferrals = _Deferrals(monkeypatch)
    with kd.MirroredStrategy(cpus(4)).scope():
        watched = _model()
        sees = _SeesWeights()
        history = watched.fit(x, y, batch_size=128, epochs=2, verbose=0, callbacks=[sees])
    assert deferrals.count == 0
    assert sees.ready == [True] * 16

    # No callback of the user's between steps: Keras's host work overlaps each step.
    with kd.MirroredStrategy(cpus(4)).scope():
        quiet = _model()
        stopping = keras.callbacks.EarlyStopping(monitor="loss", patience=5)
        quiet_history = quiet.fit(x, y, batch_size=128, epochs=2, verbose=0, callbacks=[stopping])
    assert deferrals.count == 16
    assert GATE._in_flight is None  # the loop's end waited for its last step
    np.testing.assert_allclose(quiet_history.history["loss"], history.history["loss"], rtol=1e-6)
    np.testing.assert_allclose(quiet_history.history["mae"], history.history["mae"], rtol=1e-6)
    for a, b in zip(quiet.get_weights(), watched.get_weights()):
        np.testing.assert_allclose(a, b, rtol=1e-6)


class _BatchBegin(keras.callbacks.Callback):
    def on_train_batch_begin(self, batch, logs=None):
        pass


class _AsyncSafeBatchEnd(keras.callbacks.Callback):
    async_safe = True  # Keras runs it on a thread: it still runs beside the step

    def on_batch_end(self, batch, logs=None):
        pass


@pytest.mark.parametrize(
    "callbacks, quiet",
    [
        (None, True),
        ([], True),
        ([keras.callbacks.EarlyStopping(), keras.callbacks.History()], True),
        ([keras.callbacks.ProgbarLogger()], True),
        (keras.callbacks.CallbackList([keras.callbacks.History()], add_progbar=True), True),
        ([_BatchBegin()], False),
        ([keras.callbacks.EarlyStopping(), _AsyncSafeBatchEnd()], False),
        (keras.callbacks.CallbackList([_BatchBegin()]), False),
        ("not callbacks", False),
    ],
)
def test_which_callbacks_run_nothing_between_two_steps(callbacks, quiet):
    assert quiet_between_steps(callbacks) is quiet


def test_evaluate_inside_a_quiet_fit_and_the_metrics_it_reads_match_a_single_device():
    x, y = _data()
    keras.utils.set_random_seed(7)
    single = _model()
    expected = single.fit(
        x, y, batch_size=128, epochs=2, verbose=0, validation_data=(x[:300], y[:300])
    ).history
    with kd.MirroredStrategy(cpus(4)).scope():
        model = _model()
        history = model.fit(
            x, y, batch_size=128, epochs=2, verbose=0, validation_data=(x[:300], y[:300])
        ).history
    for key in ("loss", "mae", "val_loss", "val_mae"):
        np.testing.assert_allclose(history[key], expected[key], rtol=1e-4, atol=1e-6)
    assert jax.tree_util.tree_all(
        jax.tree_util.tree_map(lambda v: v.value.is_ready(), model.trainable_variables)
    )
