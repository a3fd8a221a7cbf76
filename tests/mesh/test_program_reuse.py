"""A compiled program is kept when variables it does not use are created beside it.

Every program threads all of its strategy's variables and is keyed by their version;
a new variable in the scope makes the engine trace again, and the program it had is
kept when that trace is the same program (``_engine/_program_reuse.py``). A trace
that reads another variable or closes over another value builds a new one.
"""

import keras
import numpy as np
from conftest import cpus

import keras_dist as kd


def _programs(strategy) -> set:
    """The compiled programs the strategy's engine holds (one compile each)."""
    return {id(entry) for entry in strategy.extended._compiled._cache.values()}


def _model():
    return keras.Sequential([keras.Input((3,)), keras.layers.Dense(2), keras.layers.Dense(1)])


def _training(optimizer):
    """A strategy, a model built in it, its training replica function and a batch."""
    keras.utils.set_random_seed(1)
    strategy = kd.MirroredStrategy(cpus(2))
    with strategy.scope():
        model, optimizer = _model(), optimizer()

    def replica_fn(x):
        def loss_fn():
            return kd.nn.compute_average_loss(model(x)[:, 0] ** 2, global_batch_size=8)

        loss, grads = kd.value_and_grad(loss_fn, model.trainable_variables)()
        optimizer.apply_gradients(zip(grads, model.trainable_variables))
        return loss

    x = np.arange(24, dtype="float32").reshape(8, 3) / 24
    (batch,) = strategy.experimental_distribute_dataset([x])
    return strategy, model, replica_fn, batch


def _build_another_model(strategy):
    with strategy.scope():
        other = _model()  # created after the step was compiled
        keras.metrics.Mean()
    other.build((None, 3))


def _assert_same(got, want):
    for a, b in zip(got, want):
        np.testing.assert_allclose(a, b, rtol=1e-6)


def test_a_new_model_beside_it_keeps_the_step_and_its_numbers():
    def trained(build_another):
        strategy, model, replica_fn, batch = _training(lambda: keras.optimizers.SGD(0.1))

        def step():
            return float(strategy.reduce("SUM", strategy.run(replica_fn, args=(batch,)), None))

        losses = [step()]
        programs = _programs(strategy)
        if build_another:
            _build_another_model(strategy)
        losses.append(step())
        return losses, _programs(strategy) - programs, model.get_weights()

    alone, _, weights_alone = trained(build_another=False)
    beside, new_programs, weights_beside = trained(build_another=True)
    assert new_programs == set()  # the step's program and the reduction's were kept
    _assert_same(beside, alone)
    _assert_same(weights_beside, weights_alone)


def test_a_step_that_now_reads_a_new_variable_is_built_again():
    strategy = kd.MirroredStrategy(cpus(2))
    with strategy.scope():
        holder = [keras.Variable(1.0)]
    x = np.ones((4, 3), "float32")

    def replica_fn(inputs):
        return keras.ops.sum(inputs) * holder[0]

    def total():
        return float(strategy.reduce("SUM", strategy.run(replica_fn, args=(x,)), None))

    assert total() == 24.0  # (each of the 2 replicas: 12)
    programs = _programs(strategy)
    with strategy.scope():
        holder[0] = keras.Variable(2.0)  # the same function reads another variable now
    assert total() == 48.0
    assert _programs(strategy) - programs  # built anew, not kept


def test_a_step_that_now_writes_a_new_variable_is_built_again():
    strategy = kd.MirroredStrategy(cpus(2))
    holder = [None]

    def replica_fn():
        if holder[0] is not None:
            holder[0].assign(5.0)  # a write that reads nothing
        return 1.0

    strategy.run(replica_fn)  # writes nothing
    with strategy.scope():
        holder[0] = keras.Variable(0.0)
    strategy.run(replica_fn)
    assert float(holder[0].numpy()) == 5.0  # the write is kept: a program was built for it


def test_a_step_closing_over_a_changed_array_is_built_again():
    # Traced again after a variable was created, the step finds the array it closes
    # over changed in place: another constant, another program.
    strategy = kd.MirroredStrategy(cpus(2))
    table = np.ones(3, "float32")
    x = np.ones((4, 3), "float32")

    def replica_fn(inputs):
        return keras.ops.sum(inputs * table)

    def total():
        return float(strategy.reduce("SUM", strategy.run(replica_fn, args=(x,)), None))

    assert total() == 24.0  # (each of the 2 replicas: 12)
    table[:] = 2.0
    with strategy.scope():
        keras.Variable(0.0)
    assert total() == 48.0


def test_fit_after_another_model_was_built_compiles_nothing():
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(64, 3)).astype("float32"), rng.normal(size=(64, 1)).astype("float32")

    def fitted(build_another):
        keras.utils.set_random_seed(2)
        strategy = kd.MirroredStrategy(cpus(2))
        with strategy.scope():
            model = _model()
            model.compile(keras.optimizers.Adam(0.01), "mse", metrics=["mae"])
        model.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0)
        programs = _programs(strategy)
        if build_another:
            with strategy.scope():
                other = _model()
                other.compile("sgd", "mse")
            other.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0)
            programs |= _programs(strategy)
        history = model.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0).history
        return history, _programs(strategy) - programs, model.get_weights()

    alone, _, weights_alone = fitted(build_another=False)
    beside, new_programs, weights_beside = fitted(build_another=True)
    assert new_programs == set()
    _assert_same(beside["loss"], alone["loss"])
    _assert_same(weights_beside, weights_alone)


def test_a_kd_function_step_is_kept_when_a_model_is_built_beside_it():
    def trained(build_another):
        strategy, model, replica_fn, batch = _training(lambda: keras.optimizers.Adam(0.01))

        @kd.function
        def step(batch):
            return strategy.reduce("SUM", strategy.run(replica_fn, args=(batch,)), None)

        losses = [float(step(batch)), float(step(batch))]
        if build_another:
            _build_another_model(strategy)
        losses += [float(step(batch)), float(step(batch))]
        return losses, step.experimental_get_tracing_count(), model.get_weights()

    alone, _, weights_alone = trained(build_another=False)
    beside, programs_built, weights_beside = trained(build_another=True)
    assert programs_built == 1
    _assert_same(beside, alone)
    _assert_same(weights_beside, weights_alone)


def test_a_kd_function_that_now_reads_a_new_variable_is_built_again():
    strategy = kd.MirroredStrategy(cpus(2))
    with strategy.scope():
        holder = [keras.Variable(1.0)]

    @kd.function
    def scaled(x):
        return strategy.reduce(
            "SUM", strategy.run(lambda v: keras.ops.sum(v) * holder[0], args=(x,)), None
        )

    x = np.ones((4, 3), "float32")
    assert float(scaled(x)) == 24.0
    with strategy.scope():
        holder[0] = keras.Variable(2.0)
    assert float(scaled(x)) == 48.0
    assert scaled.experimental_get_tracing_count() == 2
