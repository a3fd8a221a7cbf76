"""Input sources beyond NumPy lists: PyDataset, Grain, generators; and reading ahead."""

import itertools
import threading

import grain
import keras
import numpy as np
import pytest
from conftest import cpus

import keras_dist as kd
from keras_dist._input import Prefetch

RNG = np.random.default_rng(0)
X = RNG.normal(size=(96, 4)).astype("float32")
Y = (X.sum(1, keepdims=True) > 0).astype("float32")


class _Batches(keras.utils.PyDataset):
    def __len__(self):
        return 6

    def __getitem__(self, index):
        return X[index * 16 : (index + 1) * 16], Y[index * 16 : (index + 1) * 16]


def _endless_batches():
    while True:
        for index in range(6):
            yield X[index * 16 : (index + 1) * 16], Y[index * 16 : (index + 1) * 16]


def _grain_batches():
    return grain.MapDataset.source([(X[i], Y[i]) for i in range(96)]).batch(16)


def _train(data, **fit_kwargs):
    keras.utils.set_random_seed(3)
    strategy = kd.MirroredStrategy(cpus(4))
    with strategy.scope():
        model = keras.Sequential(
            [
                keras.Input((4,)),
                keras.layers.Dense(8, activation="relu"),
                keras.layers.Dense(1, activation="sigmoid"),
            ]
        )
        model.compile(optimizer="sgd", loss="binary_crossentropy", metrics=["accuracy"])
    history = model.fit(data, epochs=2, verbose=0, **fit_kwargs)
    return [w.numpy() for w in model.weights], history.history


@pytest.fixture(scope="module")
def numpy_run():
    return _train(X, y=Y, batch_size=16, shuffle=False)


@pytest.mark.parametrize(
    "make_data,fit_kwargs",
    [
        (_Batches, {"shuffle": False}),
        (_grain_batches, {}),
        (_endless_batches, {"steps_per_epoch": 6}),
    ],
    ids=["pydataset", "grain", "generator"],
)
def test_fit_on_a_pipeline_equals_fit_on_arrays(numpy_run, make_data, fit_kwargs):
    weights, history = _train(make_data(), **fit_kwargs)
    np.testing.assert_allclose(history["loss"], numpy_run[1]["loss"], rtol=1e-6)
    for got, want in zip(weights, numpy_run[0]):
        np.testing.assert_allclose(got, want, atol=1e-6)


def _sparse_converter(kind):
    """A function making a dense batch a sparse matrix of ``kind`` (skips without TensorFlow)."""
    if kind == "scipy":
        import scipy.sparse

        return scipy.sparse.csr_matrix
    if kind == "jax":
        from jax.experimental import sparse

        return sparse.BCOO.fromdense
    return pytest.importorskip("tensorflow").sparse.from_dense


def _sparse_batches(to_sparse):
    """X's batches of 16, endlessly, their features sparse (the same values)."""
    for index in itertools.cycle(range(6)):
        rows = slice(index * 16, (index + 1) * 16)
        yield to_sparse(X[rows]), Y[rows]


@pytest.mark.parametrize("kind", ["scipy", "jax", "tensorflow"])
def test_sparse_inputs_train_as_their_dense_arrays(numpy_run, kind):
    # Keras's trainer tests feed SciPy, JAX and tf.data sparse batches: each
    # replica's rows are the dense rows, so the numbers are the arrays'.
    weights, history = _train(_sparse_batches(_sparse_converter(kind)), steps_per_epoch=6)
    np.testing.assert_allclose(history["loss"], numpy_run[1]["loss"], rtol=1e-6)
    for got, want in zip(weights, numpy_run[0]):
        np.testing.assert_allclose(got, want, atol=1e-6)


@pytest.mark.parametrize("source", ["pydataset", "grain_map", "grain_iter"])
def test_distribute_dataset_accepts_keras_and_grain_datasets(source):
    strategy = kd.MirroredStrategy(cpus(4))
    dataset = {
        "pydataset": _Batches(),
        "grain_map": _grain_batches(),
        "grain_iter": _grain_batches().to_iter_dataset(),
    }[source]
    distributed = strategy.experimental_distribute_dataset(dataset)
    for epoch in range(2):  # re-iterable, one pass per epoch
        steps = 0
        for step, (x, _) in enumerate(distributed):
            parts = strategy.experimental_local_results(x)
            np.testing.assert_array_equal(
                np.concatenate([np.asarray(p) for p in parts]), X[step * 16 : (step + 1) * 16]
            )
            assert [np.shape(p) for p in parts] == [(4, 4)] * 4
            steps += 1
        assert steps == 6, epoch


@pytest.mark.parametrize("source", ["pydataset", "grain_map", "grain_iter", "numpy"])
@pytest.mark.parametrize("strategy_name", ["default", "one_device"])
def test_one_replica_strategies_read_every_source_in_both_methods(strategy_name, source):
    strategy = {"default": kd.get_strategy, "one_device": lambda: kd.OneDeviceStrategy("/cpu:0")}[
        strategy_name
    ]()
    dataset = {
        "pydataset": _Batches,
        "grain_map": _grain_batches,
        "grain_iter": lambda: _grain_batches().to_iter_dataset(),
        "numpy": lambda: strategy.experimental_make_numpy_dataset((X, Y)).batch(16),
    }[source]()
    for distributed in (
        strategy.experimental_distribute_dataset(dataset),
        strategy.distribute_datasets_from_function(lambda ctx: dataset),
    ):
        steps = [np.asarray(strategy.run(lambda x, y: x * y, args=xy)) for xy in distributed]
        assert len(steps) == 6
        for step, got in enumerate(steps):
            rows = slice(step * 16, (step + 1) * 16)
            np.testing.assert_array_equal(got, X[rows] * Y[rows])


def test_fetch_to_device_false_reads_each_batch_when_needed():
    strategy = kd.MirroredStrategy(cpus(2))
    reads = []

    class Counting:
        def __iter__(self):
            for index in range(3):
                reads.append(index)
                yield np.full((2,), float(index))

    options = kd.InputOptions(experimental_fetch_to_device=False)
    iterator = iter(strategy.experimental_distribute_dataset(Counting(), options))
    next(iterator)
    assert reads == [0]
    assert [v.tolist() for v in strategy.experimental_local_results(next(iterator))] == [
        [1.0],
        [1.0],
    ]


def test_prefetch_reads_ahead_within_its_buffer():
    produced = []
    release = threading.Event()

    def source():
        for index in range(10):
            produced.append(index)
            yield index
            if index == 2:
                release.wait(timeout=30)

    prefetch = Prefetch(source(), buffer_size=2)
    assert next(prefetch) == 0
    # The producer stops after the buffer is full: never all 10 items ahead.
    assert len(produced) <= 4
    release.set()
    assert list(prefetch) == list(range(1, 10))
    with pytest.raises(StopIteration):
        next(prefetch)


def test_prefetch_hands_errors_to_the_consumer_in_order():
    def source():
        yield 1
        raise OSError("storage went away")

    prefetch = Prefetch(source(), buffer_size=3)
    assert next(prefetch) == 1
    with pytest.raises(OSError, match="storage went away"):
        next(prefetch)


def test_prefetch_buffer_size_is_validated():
    with pytest.raises(ValueError, match="Received: batches=-1"):
        kd.config.set_prefetch_buffer_size(-1)
    with pytest.raises(ValueError, match="at least 1"):
        Prefetch([], buffer_size=0)


_STRATEGIES = {
    "one_device": lambda: kd.OneDeviceStrategy("/cpu:0"),
    "mirrored": lambda: kd.MirroredStrategy(cpus(4)),
    "central_storage": lambda: kd.experimental.CentralStorageStrategy(cpus(4)),
}


@pytest.mark.parametrize("strategy_name", list(_STRATEGIES))
@pytest.mark.parametrize("source", ["pydataset", "grain", "generator"])
def test_every_source_works_in_fit_evaluate_predict(strategy_name, source):
    def run(data_fn, **fit_kwargs):
        keras.utils.set_random_seed(3)
        with _STRATEGIES[strategy_name]().scope():
            model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1, "sigmoid")])
            model.compile(optimizer="sgd", loss="binary_crossentropy", metrics=["accuracy"])
        history = model.fit(data_fn(), validation_data=data_fn(), epochs=2, verbose=0, **fit_kwargs)
        steps = {"steps": 6} if "steps_per_epoch" in fit_kwargs else {}
        evaluation = model.evaluate(data_fn(), verbose=0, **steps)
        return history.history, evaluation, model

    if source == "generator":
        kwargs = {"steps_per_epoch": 6, "validation_steps": 6}
        history, evaluation, _ = run(_endless_batches, **kwargs)
        # Keras itself reads a generator's validation batches differently from a
        # PyDataset's (it peeks one): plain Keras on the same generator is the reference.
        keras.utils.set_random_seed(3)
        plain = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1, "sigmoid")])
        plain.compile(optimizer="sgd", loss="binary_crossentropy", metrics=["accuracy"])
        reference = plain.fit(
            _endless_batches(), validation_data=_endless_batches(), epochs=2, verbose=0, **kwargs
        ).history
        reference_evaluation = plain.evaluate(_endless_batches(), steps=6, verbose=0)
        np.testing.assert_allclose(history["loss"], reference["loss"], rtol=1e-6)
        np.testing.assert_allclose(history["val_loss"], reference["val_loss"], rtol=1e-6)
        np.testing.assert_allclose(evaluation, reference_evaluation, rtol=1e-6)
        return
    make = {"pydataset": _Batches, "grain": _grain_batches}[source]
    kwargs = {"shuffle": False} if source == "pydataset" else {}
    history, evaluation, model = run(make, **kwargs)
    reference, reference_evaluation, reference_model = run(lambda: _Batches(), shuffle=False)
    np.testing.assert_allclose(history["loss"], reference["loss"], rtol=1e-6)
    np.testing.assert_allclose(history["val_accuracy"], reference["val_accuracy"])
    np.testing.assert_allclose(evaluation, reference_evaluation, rtol=1e-6)
    predictions = model.predict(make(), verbose=0)
    assert predictions.shape == (96, 1)
    np.testing.assert_allclose(predictions, reference_model.predict(X, verbose=0), rtol=1e-5)


def test_reading_ahead_keeps_keras_shuffle_order():
    # Prefetch starts reading only when the loop asks for the first batch, so
    # Keras's shuffling draws its random numbers exactly when it would alone.
    def train(strategy):
        keras.utils.set_random_seed(1)
        with strategy.scope():
            model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
            model.compile(loss="mse", optimizer=keras.optimizers.SGD(0.1))
        model.fit(X, Y, epochs=3, batch_size=16, verbose=0)  # shuffle=True
        return np.concatenate([w.numpy().ravel() for w in model.weights])

    np.testing.assert_allclose(
        train(kd.MirroredStrategy(cpus(4))), train(kd.get_strategy()), rtol=1e-6, atol=1e-6
    )
