"""A reused program reads the module globals the function reads now, not at its trace.

TF's ``strategy.run`` outside ``tf.function`` is eager, and a new ``tf.function``
traces anew: ``for scale in (1., 2., 3.): s.run(lambda x: x * scale, ...)`` at
module level gives [1, 2, 3]. keras_dist compiles ``run`` and keeps its programs,
so a program's key holds the values of the globals its code reads (those of the
same module's helper functions too).
"""

import gc
import weakref

import numpy as np
import pytest
from conftest import cpus

import keras_dist as kd
from keras_dist.coordinator import ClusterCoordinator

pytestmark = pytest.mark.timeout(120)

ONE = np.float32(1.0)
scale = 1.0
reduce_op = "SUM"
offsets = [0.0]


def _mean(strategy, per_replica):
    return float(strategy.reduce("MEAN", per_replica, axis=None))


def test_run_sees_a_changed_global(engine):
    global scale
    strategy = kd.MirroredStrategy(cpus(2))
    results = []
    for scale in (1.0, 2.0, 3.0):  # (the loop variable is the global the function reads)
        results.append(_mean(strategy, strategy.run(lambda x: x * scale, args=(ONE,))))
    assert results == [1.0, 2.0, 3.0]


def test_a_program_is_kept_while_its_globals_hold():
    global scale
    scale = 2.0
    strategy = kd.MirroredStrategy(cpus(2))
    for _ in range(3):
        assert _mean(strategy, strategy.run(lambda x: x * scale, args=(ONE,))) == 2.0
    assert strategy.extended._compiled.trace_count == 1


def test_a_reduce_op_read_from_a_global_is_the_current_one():
    global reduce_op
    strategy = kd.MirroredStrategy(cpus(2))

    def replica_fn():
        context = kd.get_replica_context()
        value = np.float32(1.0) + context.replica_id_in_sync_group
        return context.all_reduce(reduce_op, value)

    results = []
    for reduce_op in ("SUM", "MEAN"):  # noqa: B007 (the global the function reads)
        results.append(_mean(strategy, strategy.run(replica_fn)))
    assert results == [3.0, 1.5]


def _scaled(x):
    return x * scale  # a helper of the same module reads the global


def test_a_global_read_by_a_helper_function_counts():
    global scale
    strategy = kd.MirroredStrategy(cpus(2))
    results = []
    for scale in (1.0, 4.0):  # noqa: B007
        results.append(_mean(strategy, strategy.run(lambda x: _scaled(x), args=(ONE,))))
    assert results == [1.0, 4.0]


def test_a_global_list_changed_in_place_counts():
    strategy = kd.MirroredStrategy(cpus(2))
    results = []
    for offset in (0.0, 10.0):
        offsets[0] = offset
        results.append(_mean(strategy, strategy.run(lambda x: x + offsets[0], args=(ONE,))))
    assert results == [1.0, 11.0]


def test_kd_function_traces_again_for_a_changed_global():
    global scale
    strategy = kd.MirroredStrategy(cpus(2))

    @kd.function
    def step(x):
        return strategy.run(lambda v: v * scale, args=(x,))

    results = []
    for scale in (1.0, 5.0, 5.0):  # noqa: B007
        results.append(_mean(strategy, step(ONE)))
    assert results == [1.0, 5.0, 5.0]
    assert step.experimental_get_tracing_count() == 2


def test_a_scheduled_function_sees_a_changed_global():
    global scale
    cluster = kd.testing.create_in_process_cluster(num_workers=1, num_ps=1)
    strategy = kd.ParameterServerStrategy(cluster)
    coordinator = ClusterCoordinator(strategy)
    try:
        results = []
        for scale in (1.0, 2.0, 3.0):
            result = coordinator.schedule(lambda: ONE * scale)
            results.append(float(result.fetch()))
        assert results == [1.0, 2.0, 3.0]
    finally:
        coordinator.stop()


class _Scaler:
    def __init__(self, strategy):
        self.strategy = strategy
        self.scale = 1.0

    def replica_fn(self, x):
        return x * self.scale


def test_run_of_a_method_sees_a_changed_attribute():
    strategy = kd.MirroredStrategy(cpus(2))
    scaler = _Scaler(strategy)
    results = []
    for value in (1.0, 2.0, 2.0):
        scaler.scale = value
        results.append(_mean(strategy, strategy.run(scaler.replica_fn, args=(ONE,))))
    assert results == [1.0, 2.0, 2.0]
    assert strategy.extended._compiled.trace_count == 2


def test_a_closure_sees_a_changed_attribute_of_what_it_captures():
    strategy = kd.MirroredStrategy(cpus(2))
    scaler = _Scaler(strategy)
    results = []
    for value in (3.0, 4.0):
        scaler.scale = value
        results.append(_mean(strategy, strategy.run(lambda x: x * scaler.scale, args=(ONE,))))
    assert results == [3.0, 4.0]


class _Config:
    scale = 1.0


config = _Config()


def test_a_changed_attribute_of_a_global_object_counts():
    strategy = kd.MirroredStrategy(cpus(2))
    results = []
    for value in (1.0, 6.0):
        config.scale = value
        results.append(_mean(strategy, strategy.run(lambda x: x * config.scale, args=(ONE,))))
    assert results == [1.0, 6.0]


def test_what_a_program_read_is_not_kept_alive():
    # The attributes are read from the object held weakly, never through its __dict__
    # (which would keep what the object holds, a model's layers, alive after it).
    strategy = kd.MirroredStrategy(cpus(2))

    def run_once():
        scaler = _Scaler(strategy)
        scaler.payload = np.ones(4)
        assert _mean(strategy, strategy.run(lambda x: x * scaler.scale, args=(ONE,))) == 1.0
        return weakref.ref(scaler.payload)

    payload = run_once()
    gc.collect()
    assert payload() is None
