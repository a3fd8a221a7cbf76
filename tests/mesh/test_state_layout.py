"""A compiled program donates and gives back only the variables it writes."""

import keras
import numpy as np
import pytest
from conftest import cpus

import keras_dist as kd


def _entries(strategy):
    return list(strategy.extended._compiled._cache.values())


def _donated_arguments(entry) -> int:
    main = next(line for line in entry.lowered.as_text().splitlines() if "@main(" in line)
    return main.count("jax.buffer_donor = true") + main.count("tf.aliasing_output")


def _read_written_unused(strategy):
    """Three variables of ``strategy``: one a step reads, one it writes, one it ignores."""
    with strategy.scope():
        return (
            keras.Variable(np.arange(3, dtype="float32")),
            keras.Variable(np.zeros(3, "float32")),
            keras.Variable(np.zeros(5, "float32")),
        )


@pytest.mark.parametrize("devices", [1, 2])
def test_only_written_variables_are_donated_and_unused_ones_are_not_taken(devices):
    strategy = kd.MirroredStrategy(cpus(devices))
    read, written, unused = _read_written_unused(strategy)

    def step():
        written.assign_add(read.value)
        return read.value * 2

    strategy.run(step)
    read_array, unused_array = read.value, unused.value
    for _ in range(3):
        out = strategy.run(step)
    np.testing.assert_array_equal(written.numpy(), 4 * np.arange(3))
    for value in strategy.experimental_local_results(out):
        np.testing.assert_array_equal(np.asarray(value), 2 * np.arange(3))
    # The read variable still holds the array it held: it was neither donated nor replaced.
    assert read.value is read_array and unused.value is unused_array
    (entry,) = _entries(strategy)
    assert _donated_arguments(entry) == 1
    arguments = entry.lowered.as_text().split("@main(")[1].split(")")[0]
    assert "tensor<5xf32>" not in arguments  # the unused variable is not an argument


def test_a_read_variable_sharing_a_written_ones_array_is_read_as_it_was():
    strategy = kd.MirroredStrategy(cpus(2))
    with strategy.scope():
        written = keras.Variable(np.ones((2,), "float32"))
        read = keras.Variable(np.zeros((2,), "float32"))

    def step():
        written.assign_add(read.value)
        return read.value

    read.assign(written)  # one array in both: the donated one must not be the one read
    for expected in ([2.0, 2.0], [3.0, 3.0]):
        out = strategy.run(step)
        np.testing.assert_array_equal(written.numpy(), expected)
    np.testing.assert_array_equal(read.numpy(), [1.0, 1.0])
    assert [np.asarray(v).tolist() for v in strategy.experimental_local_results(out)] == [
        [1.0, 1.0]
    ] * 2


def test_a_variable_written_by_one_program_and_read_by_another_stays_current():
    strategy = kd.MirroredStrategy(cpus(2))
    with strategy.scope():
        w = keras.Variable(np.ones((2,), "float32"))

    def write():
        w.assign_add(np.ones((2,), "float32"))

    def read():
        return w.value + 0.0

    expected = 1.0
    for step in range(1, 4):
        strategy.run(write)
        expected += 1.0
        total = strategy.reduce("MEAN", strategy.run(read), axis=None)
        np.testing.assert_array_equal(np.asarray(total), [expected] * 2)
        expected = 10.0 * step
        w.assign(np.full((2,), expected, "float32"))  # written between the calls
        total = strategy.reduce("MEAN", strategy.run(read), axis=None)
        np.testing.assert_array_equal(np.asarray(total), [expected] * 2)


@pytest.mark.parametrize("replicas", [1, 4])
def test_predict_and_evaluate_after_fit_leave_weights_and_slots_in_place(replicas):
    strategy = kd.MirroredStrategy(cpus(replicas))
    x = np.random.default_rng(0).normal(size=(32, 4)).astype("float32")
    y = x @ np.arange(4, dtype="float32")[:, None]

    def build():
        keras.utils.set_random_seed(1)
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(8), keras.layers.Dense(1)])
        model.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse", metrics=["mae"])
        return model

    with strategy.scope():
        model = build()
    plain = build()
    for m in (model, plain):
        m.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0)
    held = [v.value for v in (*model.weights, *model.optimizer.variables)]
    for _ in range(2):
        np.testing.assert_allclose(
            model.predict(x, batch_size=8, verbose=0),
            plain.predict(x, batch_size=8, verbose=0),
            rtol=1e-5,
            atol=1e-6,
        )
        np.testing.assert_allclose(
            model.evaluate(x, y, batch_size=8, verbose=0),
            plain.evaluate(x, y, batch_size=8, verbose=0),
            rtol=1e-5,
        )
    assert all(v.value is a for v, a in zip((*model.weights, *model.optimizer.variables), held))
    # Training afterwards still moves every weight, as plain Keras's does.
    for m in (model, plain):
        m.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)
    for ours, theirs in zip(model.weights, plain.weights):
        np.testing.assert_allclose(ours.numpy(), theirs.numpy(), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("devices", [1, 2])
def test_a_kd_function_gives_back_only_the_variables_it_writes(devices):
    strategy = kd.MirroredStrategy(cpus(devices))
    read, written, unused = _read_written_unused(strategy)
    with strategy.scope():
        metric = keras.metrics.Sum()  # a SyncOnRead variable, written in the replicas

    def replica_step():
        written.assign_add(read.value)
        metric.update_state(read.value)
        return read.value * 2

    @kd.function
    def step():
        return strategy.reduce("MEAN", strategy.run(replica_step), axis=None)

    step()
    read_array, unused_array = read.value, unused.value
    for _ in range(3):
        out = step()
    np.testing.assert_array_equal(np.asarray(out), 2 * np.arange(3))
    np.testing.assert_array_equal(written.numpy(), 4 * np.arange(3))
    assert float(metric.result()) == 4 * 3 * devices
    assert read.value is read_array and unused.value is unused_array
    (program,) = step._programs.values()
    arguments = program.lowered.as_text().split("@main(")[1].split(") ->")[0]
    assert "tensor<5xf32>" not in arguments
    assert _donated_arguments(program) == 2  # `written` and the metric's `total`
