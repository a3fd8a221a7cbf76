"""The Keras internals keras_dist relies on (keras_dist/_keras/) behave as the hooks expect.

When one of these fails after a Keras upgrade, the hook in `keras_dist/_keras/`
that names the same internal needs updating. `test_keras_internals.py` checks
that every symbol on the list is present, with its parameters.
"""

import inspect

import keras
import numpy as np
from conftest import cpus
from keras.src.backend.common import global_state
from keras.src.backend.common.stateless_scope import StatelessScope
from keras.src.backend.jax.core import JaxVariable
from keras.src.optimizers import base_optimizer

import keras_dist as kd
from keras_dist import _keras as keras_hooks
from keras_dist._keras import _variable_hooks as _variable_hooks


def test_keras_asks_the_distribution_for_variable_layouts():
    source = inspect.getsource(_variable_hooks._original_initialize_layout)
    assert "get_variable_layout" in source
    assert global_state.get_global_attribute("distribution") is None


def test_variable_storage_attributes_exist():
    v = keras.Variable(np.ones(2, "float32"))
    assert isinstance(v, JaxVariable)
    assert hasattr(v, "_value") and hasattr(v, "_layout")
    assert "_direct_assign" in JaxVariable.__dict__


def test_stateless_scope_maps_variables_by_id():
    v = keras.Variable(1.0)
    with StatelessScope(state_mapping=[(v, 2.0)]) as scope:
        assert float(v.value) == 2.0
        v.assign(3.0)
    assert isinstance(scope.state_mapping, dict)
    assert float(scope.state_mapping[id(v)]) == 3.0
    assert float(v.value) == 1.0


def test_variables_created_in_a_stateless_scope_are_pending():
    with StatelessScope():
        v = keras.Variable(initializer="zeros", shape=(2,))
        assert v in keras_hooks.pending_variables()
    assert v._value is not None


def test_optimizer_apply_is_hooked_and_slots_copy_the_reference_layout():
    assert getattr(base_optimizer.BaseOptimizer.apply, "_keras_dist_hook", False)
    assert "layout" in inspect.getsource(base_optimizer.BaseOptimizer.add_variable_from_reference)
    strategy = kd.MirroredStrategy(cpus(2))
    with strategy.scope():
        w = keras.Variable(np.ones(2, "float32"))
        optimizer = keras.optimizers.Adam()
        optimizer.build([w])
    assert all(isinstance(v, kd.MirroredVariable) for v in optimizer.variables)


def test_keras_variable_class_can_be_swapped():
    strategy = kd.MirroredStrategy(cpus(2))
    with strategy.scope():
        layer = keras.layers.Dense(2)
        layer.build((None, 3))
    assert all(isinstance(v, kd.MirroredVariable) for v in layer.weights)
    assert all(len(v.value.sharding.device_set) == 2 for v in layer.weights)


def test_saving_under_a_strategy_creates_no_variables_and_compiles_nothing_again(tmp_path):
    # Keras 3.15's saving builds throwaway reference objects (an Optimizer among
    # them) on every save; the hook builds them once, outside the strategy.
    from keras.src.saving import saving_lib

    assert getattr(saving_lib.get_attr_skipset, "_keras_dist_hook", False)
    strategy = kd.MirroredStrategy(cpus(2))
    with strategy.scope():
        model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
        model.compile(optimizer="sgd", loss="mse")
    x, y = np.ones((8, 3), "float32"), np.ones((8, 1), "float32")
    model.fit(x, y, batch_size=4, verbose=0)
    version = strategy.extended._variables_version
    traces = strategy.extended._compiled.trace_count
    with strategy.scope():  # as callbacks save, inside fit
        for name in ("a", "b"):
            model.save_weights(tmp_path / f"{name}.weights.h5")
            model.save(tmp_path / f"{name}.keras")
    model.fit(x, y, batch_size=4, verbose=0)
    assert strategy.extended._variables_version == version
    assert strategy.extended._compiled.trace_count == traces
