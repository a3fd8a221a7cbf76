"""On accelerators ``fit`` puts each batch on the devices a step ahead (``_device_ahead.py``).

This machine has only CPU devices, where nothing is put ahead; the tests turn it
on and check that the steps take the rows put ahead, that the numbers stay one
device's, and that batches no step takes stop being put ahead.
"""

import keras
import numpy as np
import pytest
from conftest import cpus
from conftest import tpu_strategy

import keras_dist as kd
from keras_dist._keras_steps import _device_ahead
from keras_dist._keras_steps._device_ahead import PlacedAhead
from keras_dist._keras_steps._device_ahead import batches_ahead
from keras_dist._keras_steps._device_ahead import puts_ahead


def _data(rows=300):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(rows, 6)).astype("float32")
    y = (x @ rng.normal(size=(6, 1))).astype("float32")
    return x, y


def _model(steps_per_execution=1):
    keras.utils.set_random_seed(3)
    model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(16), keras.layers.Dense(1)])
    model.compile(
        optimizer=keras.optimizers.Adam(0.01),
        loss="mse",
        metrics=["mae"],
        steps_per_execution=steps_per_execution,
    )
    return model


class _Spy:
    """Counts the batches put ahead and the steps that took theirs."""

    def __init__(self, monkeypatch):
        self.put = self.taken = 0
        store = PlacedAhead()
        original_put, original_take = store.put, store.take

        def put(batch, extended):
            leaves = original_put(batch, extended)
            self.put += leaves is not None
            return leaves

        def take(leaves, sharding):
            rows = original_take(leaves, sharding)
            self.taken += rows is not None
            return rows

        store.put, store.take = put, take
        monkeypatch.setattr(_device_ahead, "PLACED_AHEAD", store)
        # As on a GPU: this machine's CPU devices would not put anything ahead.
        monkeypatch.setattr(_device_ahead, "puts_ahead", lambda extended: True)


STRATEGIES = {
    "one replica": lambda: kd.MirroredStrategy(cpus(1)),
    "four replicas": lambda: kd.MirroredStrategy(cpus(4)),
    # Replicas of two cores each: the rows are split between replicas, whole on each core.
    "tpu, 2 cores a replica": lambda: tpu_strategy(2, 2),
    "central storage": lambda: kd.experimental.CentralStorageStrategy(cpus(2)),
}


@pytest.mark.parametrize("strategy_name", list(STRATEGIES))
def test_steps_take_the_rows_put_ahead_and_give_one_devices_numbers(strategy_name, monkeypatch):
    x, y = _data()  # 9 batches of 32 and a partial one of 12
    expected_model = _model()
    expected = expected_model.fit(
        x, y, batch_size=32, epochs=3, validation_split=0.2, shuffle=False, verbose=0
    )

    spy = _Spy(monkeypatch)
    with STRATEGIES[strategy_name]().scope():
        model = _model()
    history = model.fit(
        x, y, batch_size=32, epochs=3, validation_split=0.2, shuffle=False, verbose=0
    )

    for name, values in expected.history.items():
        np.testing.assert_allclose(
            history.history[name], values, rtol=1e-5, atol=1e-6, err_msg=name
        )
    for mine, reference in zip(model.get_weights(), expected_model.get_weights()):
        np.testing.assert_allclose(mine, reference, rtol=1e-5, atol=1e-6)
    # 240 training rows: 7 batches of 32 and one of 16; 60 for validation: one of 32
    # and one of 28 (all split evenly). The first batch of each of these 4 layouts
    # goes through ``strategy.run``; every later one takes its rows from the devices.
    assert spy.taken == 3 * (8 + 2) - 4
    assert spy.put >= spy.taken


def test_predict_takes_the_rows_put_ahead_and_gives_one_devices_outputs(monkeypatch):
    x, _ = _data()  # 9 batches of 32 and a partial one of 12 (padded: new arrays)
    expected = _model().predict(x, batch_size=32, verbose=0)

    spy = _Spy(monkeypatch)
    with kd.MirroredStrategy(cpus(4)).scope():
        model = _model()
    predictions = model.predict(x, batch_size=32, verbose=0)

    np.testing.assert_allclose(predictions, expected, rtol=1e-5, atol=1e-6)
    # The first batch runs through ``strategy.run``; the 8 full ones after it take
    # their rows from the devices; the padded last one is copied by its step.
    assert spy.taken == 8


def test_batches_no_step_takes_stop_being_put_ahead(monkeypatch):
    x, y = _data(320)
    expected_model = _model(steps_per_execution=2)
    expected = expected_model.fit(x, y, batch_size=32, epochs=2, shuffle=False, verbose=0)

    spy = _Spy(monkeypatch)
    with kd.MirroredStrategy(cpus(2)).scope():
        model = _model(steps_per_execution=2)  # two batches a call: no step takes rows put ahead
    history = model.fit(x, y, batch_size=32, epochs=2, shuffle=False, verbose=0)

    np.testing.assert_allclose(history.history["loss"], expected.history["loss"], rtol=1e-5)
    assert spy.taken == 0
    # Each loop stops after two batches missed (and the one read meanwhile): without
    # that, all 20 batches of the two epochs would be put ahead.
    assert spy.put <= 10


def test_batches_ahead_yields_every_batch_in_order_and_drops_what_was_not_taken(monkeypatch):
    store = PlacedAhead()
    monkeypatch.setattr(_device_ahead, "PLACED_AHEAD", store)
    extended = kd.MirroredStrategy(cpus(2)).extended
    batches = [(np.full((4, 1), i, "float32"),) for i in range(5)]
    seen = []
    for batch in batches_ahead(iter(batches), extended):
        seen.append(batch)
        if len(seen) <= 2:  # the first two steps take theirs; the rest do not
            rows = store.take(list(batch), extended.placement.split)
            np.testing.assert_array_equal(np.asarray(rows[0]).reshape(4, 1), batch[0])
    assert [b[0][0, 0] for b in seen] == [0, 1, 2, 3, 4]
    assert all(a is b for a, b in zip(seen, batches))
    assert len(store._batches) == 0  # batch 2 and 3 missed: batch 4 was not put ahead


def test_only_even_numpy_batches_are_put_and_at_most_two_are_held():
    extended = kd.MirroredStrategy(cpus(4)).extended
    store = PlacedAhead()
    assert store.put((np.ones((6, 2)),), extended) is None  # 6 rows do not split over 4
    assert store.put(([1.0, 2.0, 3.0, 4.0],), extended) is None  # not NumPy rows
    held = [(np.full((8, 2), i, "float32"),) for i in range(3)]
    assert all(store.put(batch, extended) is not None for batch in held)
    assert store.take(list(held[0]), extended.placement.split) is None  # the oldest went
    rows = store.take(list(held[2]), extended.placement.split)
    assert rows[0].shape == (4, 2, 2) and rows[0].sharding == extended.placement.split


def test_cpu_devices_and_the_default_strategy_put_nothing_ahead():
    assert not puts_ahead(kd.MirroredStrategy(cpus(4)).extended)
    assert not puts_ahead(kd.get_strategy().extended)
