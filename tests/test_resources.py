"""Nothing leaks: read-ahead threads end, dropped models are freed, threads are serialized."""

import gc
import threading
import time

import jax
import keras
import numpy as np
import pytest
from conftest import cpus

import keras_dist as kd
from keras_dist._values._variables import DistributedVariable


def _prefetch_threads() -> int:
    return sum(t.name == "keras_dist-prefetch" for t in threading.enumerate())


def _ours(thread_name) -> bool:
    # In-process parameter servers of earlier tests (kd.testing keeps them for the
    # process, as TF does) grow their pools ("kd-/job:ps/...") whenever a collection
    # frees remote values: theirs, not this test's.
    if thread_name.startswith("kd-/job:"):
        return False
    return thread_name.startswith(("keras_dist", "keras-dist", "kd-"))


def _settled_thread_count(deadline=5.0) -> int:
    """The thread count once stopped read-ahead threads have ended (each within a poll)."""
    gc.collect()
    end = time.monotonic() + deadline
    while _prefetch_threads() and time.monotonic() < end:
        time.sleep(0.02)
    return threading.active_count()


def _model(strategy, features=8):
    with strategy.scope():
        model = keras.Sequential(
            [
                keras.Input((features,)),
                keras.layers.Dense(16, activation="relu"),
                keras.layers.Dense(3),
            ]
        )
        model.compile(
            optimizer="adam",
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            metrics=["accuracy"],
        )
    return model


def _data(rows=96, features=8, seed=0):
    rng = np.random.default_rng(seed)
    return rng.random((rows, features), dtype=np.float32), rng.integers(0, 3, rows)


def test_forty_early_breaks_leave_no_read_ahead_thread():
    strategy = kd.MirroredStrategy(cpus(2))
    batches = [np.full((4, 2), i, np.float32) for i in range(10)]
    dataset = strategy.experimental_distribute_dataset(batches)
    before = set(threading.enumerate())
    for _ in range(40):
        for step, _ in enumerate(dataset):
            if step == 1:
                break
    _settled_thread_count()
    # Ours only: the suite's other threads (pools, watchers of earlier tests) come and go.
    left = [t.name for t in set(threading.enumerate()) - before if _ours(t.name)]
    assert left == []
    assert _prefetch_threads() == 0


def test_an_abandoned_iterator_stops_its_thread_without_a_collection():
    strategy = kd.MirroredStrategy(cpus(2))
    batches = [np.full((4, 2), i, np.float32) for i in range(10)]
    iterator = iter(strategy.experimental_distribute_dataset(batches))
    first = next(iterator)
    assert [float(v[0, 0]) for v in strategy.experimental_local_results(first)] == [0.0, 0.0]
    assert _prefetch_threads() == 1
    del iterator  # no gc.collect(): dropping the last reference is enough
    end = time.monotonic() + 5
    while _prefetch_threads() and time.monotonic() < end:
        time.sleep(0.02)
    assert _prefetch_threads() == 0


class _StopAfterTwoBatches(keras.callbacks.Callback):
    def on_train_batch_end(self, batch, logs=None):
        if batch == 1:
            self.model.stop_training = True


class _RaiseAtSecondBatch(keras.callbacks.Callback):
    def on_train_batch_end(self, batch, logs=None):
        if batch == 1:
            raise RuntimeError("stop here")


class _Batches(keras.utils.PyDataset):
    """Batches of ``x`` and ``y`` from a ``PyDataset``: an input ``fit`` reads ahead."""

    def __init__(self, x, y, batch_size):
        super().__init__()
        self.x, self.y, self.batch_size = x, y, batch_size

    def __len__(self):
        return len(self.x) // self.batch_size

    def __getitem__(self, index):
        rows = slice(index * self.batch_size, (index + 1) * self.batch_size)
        return self.x[rows], self.y[rows]


class _ReadAheadThreads(keras.callbacks.Callback):
    """The read-ahead threads alive at the end of each training batch."""

    def __init__(self):
        super().__init__()
        self.counts = []

    def on_train_batch_end(self, batch, logs=None):
        self.counts.append(_prefetch_threads())


def test_fit_reads_ahead_from_a_py_dataset_but_slices_arrays_in_memory_when_needed():
    strategy = kd.MirroredStrategy(cpus(2))
    model = _model(strategy)
    x, y = _data()
    _settled_thread_count()
    from_arrays, from_dataset = _ReadAheadThreads(), _ReadAheadThreads()
    model.fit(x, y, batch_size=8, callbacks=[from_arrays], verbose=0)
    model.fit(_Batches(x, y, 8), callbacks=[from_dataset], verbose=0)
    assert from_arrays.counts == [0] * 12
    # One thread reads ahead from the start; it ends once it has read the last batch.
    assert len(from_dataset.counts) == 12 and from_dataset.counts[0] == 1
    assert set(from_dataset.counts) <= {0, 1}


def test_fit_closes_its_read_ahead_however_the_loop_ends():
    strategy = kd.MirroredStrategy(cpus(2))
    model = _model(strategy)
    x, y = _data()
    _settled_thread_count()
    before = set(threading.enumerate())
    model.fit(_Batches(x, y, 8), epochs=2, steps_per_epoch=3, verbose=0)
    model.fit(_Batches(x, y, 8), epochs=3, callbacks=[_StopAfterTwoBatches()], verbose=0)
    model.evaluate(_Batches(x, y, 8), steps=2, verbose=0)
    x_nan = np.full_like(x, np.nan)
    terminate = keras.callbacks.TerminateOnNaN()
    model.fit(_Batches(x_nan, y, 8), callbacks=[terminate], verbose=0)
    assert model.stop_training
    with pytest.raises(RuntimeError, match="stop here"):
        model.fit(_Batches(x, y, 8), callbacks=[_RaiseAtSecondBatch()], verbose=0)
    # The raised error's traceback still holds the loop's frames: the loop closed
    # its readers itself (their threads end within a poll), nothing was collected.
    end = time.monotonic() + 5
    while _prefetch_threads() and time.monotonic() < end:
        time.sleep(0.02)
    assert _prefetch_threads() == 0
    # None of ours left behind (the suite's other threads come and go meanwhile).
    _settled_thread_count()
    assert [t.name for t in set(threading.enumerate()) - before if _ours(t.name)] == []


def _live_distributed_variables() -> int:
    return sum(isinstance(o, DistributedVariable) for o in gc.get_objects())


def test_building_fitting_and_dropping_models_keeps_memory_flat():
    strategy = kd.MirroredStrategy(cpus(4))
    x, y = _data()
    arrays = []
    for _ in range(16):
        model = _model(strategy)
        model.fit(x, y, batch_size=16, epochs=1, verbose=0)
        del model
        gc.collect()
        arrays.append(len(jax.live_arrays()))
    # Flat (within 20%) after the first rounds, and no dead model's variable alive.
    assert max(arrays[4:]) <= 1.2 * max(arrays[1], 1)
    assert _live_distributed_variables() == 0


def test_a_surviving_model_does_not_slow_down_as_others_come_and_go():
    strategy = kd.MirroredStrategy(cpus(2))
    survivor = _model(strategy)
    x, y = _data()
    survivor.fit(x, y, batch_size=16, epochs=1, verbose=0)
    threaded_alone = strategy.extended.variable_state()
    alone = len(threaded_alone.mirrored) + len(threaded_alone.sync_on_read)
    for _ in range(8):
        model = _model(strategy)
        model.fit(x, y, batch_size=16, epochs=1, verbose=0)
        del model
    gc.collect()
    survivor.fit(x, y, batch_size=16, epochs=1, verbose=0)
    state = strategy.extended.variable_state()
    # The strategy threads only the survivor's variables through its programs again.
    assert len(state.mirrored) + len(state.sync_on_read) == alone


def test_two_threads_fitting_under_one_strategy_end_without_a_crash():
    strategy = kd.MirroredStrategy(cpus(4))
    models = [_model(strategy), _model(strategy)]
    start = [m.get_weights() for m in models]
    x, y = _data(rows=128)
    errors = []

    def train(model):
        try:
            model.fit(x, y, batch_size=16, epochs=3, shuffle=False, verbose=0)
        except BaseException as error:  # reported below
            errors.append(error)

    threads = [threading.Thread(target=train, args=(m,)) for m in models]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=240)
    assert not any(t.is_alive() for t in threads)
    assert errors == []
    # Serialized fits give the weights of each model trained alone.
    for model, weights in zip(models, start):
        assert int(model.optimizer.iterations) == 3 * 128 // 16
        alone = _model(kd.MirroredStrategy(cpus(4)))
        alone.set_weights(weights)
        alone.fit(x, y, batch_size=16, epochs=3, shuffle=False, verbose=0)
        for got, expected in zip(model.get_weights(), alone.get_weights()):
            np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6)


def test_strategy_run_from_two_threads_is_serialized():
    strategy = kd.MirroredStrategy(cpus(4))
    with strategy.scope():
        total = keras.Variable(0.0, aggregation="mean")
    errors = []

    def step():
        total.assign_add(1.0)  # the replicas' mean: +1 a step
        return total.value

    def hammer():
        try:
            for _ in range(50):
                strategy.run(step)
        except BaseException as error:  # reported below
            errors.append(error)

    threads = [threading.Thread(target=hammer) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert errors == []
    assert float(total.value) == 100.0  # 2 threads x 50 steps, none lost
