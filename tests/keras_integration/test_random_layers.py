"""Random layers (Dropout, noise, augmentation) draw each replica's own numbers, as
tf.keras's replicas do; one replica draws exactly what plain Keras draws."""

import keras
import numpy as np
import pytest
from conftest import cpus

import keras_dist as kd


def _dropout(strategy):
    with strategy.scope() if strategy else keras.name_scope("plain"):
        layer = keras.layers.Dropout(0.5, seed=7)
        layer.build((8, 64))
    return layer


def test_each_replica_drops_its_own_rows():
    strategy = kd.MirroredStrategy(cpus(4))
    layer = _dropout(strategy)
    ones = strategy.experimental_distribute_values_from_function(
        lambda context: np.ones((8, 64), "float32")
    )
    masks = [
        np.asarray(v) != 0
        for v in strategy.experimental_local_results(
            strategy.run(lambda x: layer(x, training=True), args=(ones,))
        )
    ]
    for i in range(4):
        assert 0.4 < masks[i].mean() < 0.6
        for j in range(i):
            assert (masks[i] != masks[j]).mean() > 0.3  # independent: about half differ
    # The generator's state moved on once, as one device's does for one call.
    plain = _dropout(None)
    plain(np.ones((8, 64), "float32"), training=True)
    np.testing.assert_array_equal(
        np.asarray(layer.seed_generator.state.value), np.asarray(plain.seed_generator.state.value)
    )


@pytest.mark.parametrize(
    "make_strategy",
    [lambda: kd.OneDeviceStrategy("/cpu:0"), lambda: kd.MirroredStrategy(cpus(1))],
    ids=["one_device", "mirrored_1"],
)
def test_one_replica_draws_plain_kerass_mask(make_strategy):
    strategy = make_strategy()
    layer, plain = _dropout(strategy), _dropout(None)
    x = np.ones((8, 64), "float32")
    ours = strategy.run(lambda: layer(x, training=True))
    np.testing.assert_array_equal(
        np.asarray(strategy.experimental_local_results(ours)[0]),
        np.asarray(plain(x, training=True)),
    )
