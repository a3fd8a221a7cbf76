"""A ``kd.function`` that reads its input itself reads it afresh on every call, as TF's.

TF's "Distributed input" tutorial loops over a distributed dataset inside a
``tf.function``, and over ``get_next_as_optional()``. A program would keep the
batches its trace read, so such a function runs its Python on each call (each
``strategy.run`` in it compiled). Its custom loops also call ``next(iterator)``
several times per call: those elements are read before the call, as many as the
body takes, and the steps compile into one program. The expected numbers are
TF 2.21's on 4 logical CPUs, or those of the same loop run without ``kd.function``.
"""

import keras
import numpy as np
import pytest
from conftest import cpus

import keras_dist as kd


class _ChangingData:
    """Global batches whose values the test changes between calls (as new epochs would)."""

    def __init__(self):
        self.value = 1.0

    def __iter__(self):
        return iter([np.full(4, self.value, "float32")] * 2)


def _summed_into(strategy):
    with strategy.scope():
        return keras.Variable(0.0, aggregation="sum")


def test_a_loop_over_a_dataset_inside_reads_each_calls_data():
    strategy = kd.MirroredStrategy(cpus(4))
    data = _ChangingData()
    dataset = strategy.experimental_distribute_dataset(data)
    total = _summed_into(strategy)

    @kd.function
    def epoch_sum(dataset):
        total.assign(0.0)
        for x in dataset:
            strategy.run(lambda v: total.assign_add(v.sum()), args=(x,))
        return total.value

    sums = []
    for value in (1.0, 2.0, 3.0):
        data.value = value
        sums.append(float(epoch_sum(dataset)))
    assert sums == [8.0, 16.0, 24.0]  # TF's; a program kept from the trace gave 8, 8, 8
    assert epoch_sum.experimental_get_tracing_count() == 0


def test_a_captured_dataset_with_a_partial_batch_gives_tfs_sums():
    strategy = kd.MirroredStrategy(cpus(4))
    rows = np.arange(10, dtype="float32")
    dataset = strategy.experimental_distribute_dataset([rows[i : i + 4] for i in (0, 4, 8)])
    total = _summed_into(strategy)

    @kd.function
    def add_epoch():
        for x in dataset:  # the last step: rows 8, 9 on replicas 0 and 1
            strategy.run(lambda v: total.assign_add(v.sum()), args=(x,))
        return total.value

    assert [float(add_epoch()), float(add_epoch())] == [45.0, 90.0]  # TF 2.21's


def test_a_get_next_as_optional_loop_inside_gives_tfs_steps():
    strategy = kd.MirroredStrategy(cpus(4))
    batches = [np.arange(0.0, 4.0), np.arange(4.0, 8.0), np.array([8.0])]
    dataset = strategy.experimental_distribute_dataset(batches)

    @kd.function
    def read_all(iterator):
        steps = []
        while True:
            optional = iterator.get_next_as_optional()
            if not optional.has_value():
                return steps
            steps.append(strategy.experimental_local_results(optional.get_value()))

    steps = [[v.tolist() for v in step] for step in read_all(iter(dataset))]
    # TF: ([0],[1],[2],[3]), ([4],[5],[6],[7]), ([8],[],[],[]).
    assert steps == [
        [[0.0], [1.0], [2.0], [3.0]],
        [[4.0], [5.0], [6.0], [7.0]],
        [[8.0], [], [], []],
    ]


@pytest.mark.parametrize("replicas", [1, 2, 3, 4])
def test_a_get_next_as_optional_loop_called_again_at_the_end_returns_as_tfs(replicas):
    # The input guide's `train_fn(iterator)`; 6 rows in global batches of 3. TF 2.21:
    # the first call runs 2 steps, a call on the used-up iterator finds no value (0).
    strategy = kd.MirroredStrategy(cpus(replicas))
    batches = [np.arange(0.0, 3.0), np.arange(3.0, 6.0)]
    iterator = iter(strategy.experimental_distribute_dataset(batches))

    @kd.function
    def train_fn(iterator):
        steps, summed = 0, 0.0
        for _ in range(5):
            optional = iterator.get_next_as_optional()
            if not optional.has_value():
                break
            doubled = strategy.run(lambda x: x * 2, args=(optional.get_value(),))
            summed = summed + strategy.reduce("SUM", doubled, axis=0)
            steps += 1
        return steps, summed

    steps, summed = train_fn(iterator)
    assert (steps, float(summed)) == (2, 30.0)
    assert train_fn(iterator) == (0, 0.0)


def test_several_next_calls_per_call_read_in_order_then_out_of_range():
    strategy = kd.MirroredStrategy(cpus(2))
    batches = [np.full(2, float(i), "float32") for i in range(6)]
    iterator = iter(strategy.experimental_distribute_dataset(batches))

    @kd.function
    def two_steps(iterator):
        first = strategy.reduce("SUM", next(iterator), axis=0)
        return first + strategy.reduce("SUM", next(iterator), axis=0)

    # The first call's element, read ahead for a program, is not lost.
    assert [float(two_steps(iterator)) for _ in range(3)] == [2.0, 10.0, 18.0]
    with pytest.raises(kd.errors.OutOfRangeError, match="End of sequence"):
        two_steps(iterator)


def test_a_captured_iterator_read_inside_advances_on_every_call():
    strategy = kd.MirroredStrategy(cpus(2))
    iterator = iter(
        strategy.experimental_distribute_dataset([np.full(2, i, "f4") for i in range(3)])
    )

    @kd.function
    def step():
        return strategy.reduce("SUM", next(iterator), axis=0)

    assert [float(step()) for _ in range(3)] == [0.0, 2.0, 4.0]


def test_training_that_builds_its_optimizer_inside_equals_the_plain_loop():
    """The optimizer's slots, created in the trace that found the loop, get their values."""

    def train(compiled):
        strategy = kd.MirroredStrategy(cpus(4))
        keras.utils.set_random_seed(3)
        with strategy.scope():
            model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
            optimizer = keras.optimizers.Adam(0.1)
        rng = np.random.default_rng(0)
        x, y = rng.normal(size=(10, 3)).astype("f4"), rng.normal(size=(10, 1)).astype("f4")
        dataset = strategy.experimental_distribute_dataset(
            [(x[i : i + 4], y[i : i + 4]) for i in (0, 4, 8)]
        )

        def replica_step(xb, yb):
            def loss_fn():
                per_example = keras.ops.mean((model(xb) - yb) ** 2, axis=-1)
                return kd.nn.compute_average_loss(per_example, global_batch_size=4)

            loss, grads = kd.value_and_grad(loss_fn, model.trainable_variables)()
            optimizer.apply(grads, model.trainable_variables)
            return loss

        def epoch(first, dataset):
            # The first step makes the optimizer's slots, in the trace that then meets the loop.
            losses = [strategy.reduce("SUM", strategy.run(replica_step, args=first), axis=None)]
            for batch in dataset:
                losses.append(strategy.reduce("SUM", strategy.run(replica_step, args=batch), None))
            return [float(loss) for loss in losses]

        run = kd.function(epoch) if compiled else epoch
        first = next(iter(dataset))
        losses = run(first, dataset) + run(first, dataset)
        return losses, [w.numpy() for w in model.weights], int(optimizer.iterations.numpy())

    losses, weights, iterations = train(compiled=True)
    plain_losses, plain_weights, plain_iterations = train(compiled=False)
    np.testing.assert_allclose(losses, plain_losses, rtol=1e-6)
    for w, p in zip(weights, plain_weights):
        np.testing.assert_allclose(w, p, rtol=1e-6)
    assert iterations == plain_iterations == 8


def test_get_next_past_the_end_raises_tfs_out_of_range_error():
    strategy = kd.MirroredStrategy(cpus(2))
    iterator = iter(strategy.experimental_distribute_dataset([np.arange(2.0)]))
    iterator.get_next()
    with pytest.raises(kd.errors.OutOfRangeError, match="End of sequence") as raised:
        iterator.get_next()
    assert isinstance(raised.value, StopIteration)  # `except StopIteration` still works

    @kd.function
    def step(iterator):
        return strategy.reduce("SUM", next(iterator), axis=0)

    with pytest.raises(kd.errors.OutOfRangeError):  # TF: a call on an exhausted iterator
        step(iterator)


def test_an_uneven_first_element_of_an_iterator_argument_is_read_by_the_python():
    strategy = kd.MirroredStrategy(cpus(2))
    batches = [np.arange(3.0), np.arange(3.0, 5.0), np.arange(5.0, 8.0), np.arange(8.0, 10.0)]
    iterator = iter(strategy.experimental_distribute_dataset(batches))  # 2/1 rows, then 1/1

    @kd.function
    def two_steps(iterator):
        first = strategy.reduce("SUM", next(iterator), axis=0)
        return first + strategy.reduce("SUM", next(iterator), axis=0)

    assert [float(two_steps(iterator)) for _ in range(2)] == [10.0, 35.0]


def test_a_variable_created_in_the_trace_that_met_the_loop_keeps_its_value():
    # The variable is made in the trace that then meets the loop; it gets its first
    # value there, so the Python run's steps count from it and a later compiled
    # strategy.run does not initialize it again ("already initialized" before).
    strategy = kd.MirroredStrategy(cpus(4))
    dataset = strategy.experimental_distribute_dataset([np.ones(4, "float32")] * 2)
    made = {}

    @kd.function
    def count_steps(dataset):
        if "steps" not in made:
            with strategy.scope():
                made["steps"] = keras.Variable(keras.initializers.Constant(5.0), shape=())
        for x in dataset:
            made["steps"].assign_add(1.0)
            strategy.run(lambda v: v * 2.0, args=(x,))
        return made["steps"].value

    assert [float(count_steps(dataset)) for _ in range(2)] == [7.0, 9.0]  # as TF's


def test_a_loop_over_a_step_count_argument_runs_as_tfs_multi_step_function():
    # TF's TPU guide: `for _ in tf.range(steps): strategy.run(step_fn, (next(it),))` with
    # `steps` a tensor, ported as `range(steps)` of an array. JAX cannot take the range of
    # a traced value (TracerIntegerConversionError); the function runs its Python instead.
    # TF 2.21: 24.0 after 3 steps, 80.0 after 2 more.
    strategy = kd.MirroredStrategy(cpus(4))
    with strategy.scope():
        total = keras.Variable(0.0)
    data = [np.full((8, 1), i, "float32") for i in range(6)]
    iterator = iter(strategy.experimental_distribute_dataset(data))

    def step_fn(x):
        def add(strategy, value):
            total.assign_add(strategy.reduce("SUM", value, axis=None))

        kd.get_replica_context().merge_call(add, args=(keras.ops.sum(x),))

    @kd.function
    def train_multiple_steps(iterator, steps):
        for _ in range(steps):
            strategy.run(step_fn, args=(next(iterator),))

    train_multiple_steps(iterator, np.asarray(3, "int32"))
    assert float(total.value) == 24.0
    train_multiple_steps(iterator, np.asarray(2, "int32"))
    assert float(total.value) == 80.0

    @kd.function
    def positive(x):
        return x * 2.0 if x > 0 else -x  # Python control flow on an input's value

    assert [float(positive(np.float32(v))) for v in (3.0, -1.0)] == [6.0, 1.0]


def _model_and_optimizer(strategy):
    keras.utils.set_random_seed(3)
    with strategy.scope():
        model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
        optimizer = keras.optimizers.SGD(0.1, momentum=0.9)
    return model, optimizer


def _replica_step(strategy, model, optimizer):
    def step_fn(x):
        def loss_fn():
            return kd.nn.compute_average_loss(
                keras.ops.sum(model(x) ** 2, axis=1), global_batch_size=8
            )

        loss, grads = kd.value_and_grad(loss_fn, model.trainable_variables)()
        optimizer.apply(grads, model.trainable_variables)
        return loss

    def step(batch):
        return strategy.reduce("SUM", strategy.run(step_fn, args=(batch,)), axis=None)

    return step


def test_a_loop_of_steps_on_next_is_one_program_with_the_steps_values():
    # TF's multi-step loop with a Python count (`steps_per_execution` of a custom loop):
    # one program of `steps` steps a call, each on the next element, as many read as taken.
    strategy = kd.MirroredStrategy(cpus(2))
    rng = np.random.RandomState(0)
    data = [rng.rand(8, 3).astype("float32") for _ in range(8)] + [rng.rand(5, 3).astype("float32")]

    model, optimizer = _model_and_optimizer(strategy)
    step = _replica_step(strategy, model, optimizer)

    @kd.function
    def train_steps(iterator, steps):
        losses = []
        for _ in range(steps):
            losses.append(step(next(iterator)))
        return losses

    iterator = iter(strategy.experimental_distribute_dataset(data))
    losses = [float(x) for x in train_steps(iterator, 3)] + [
        float(x) for x in train_steps(iterator, 3)
    ]
    assert train_steps.experimental_get_tracing_count() == 1  # compiled, not run as Python
    losses += [float(x) for x in train_steps(iterator, 2)]  # another count: another program
    assert train_steps.experimental_get_tracing_count() == 2
    # One full batch and the partial one are left: the call runs as Python, reads both,
    # and raises at the end, as TF's program does after its steps ran.
    with pytest.raises(kd.errors.OutOfRangeError):
        train_steps(iterator, 3)

    reference, ref_optimizer = _model_and_optimizer(strategy)
    ref_step = _replica_step(strategy, reference, ref_optimizer)
    expected = [float(ref_step(batch)) for batch in strategy.experimental_distribute_dataset(data)]
    np.testing.assert_allclose(losses, expected[:8], rtol=1e-6)
    for got, want in zip(model.get_weights(), reference.get_weights()):
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7)
    assert int(optimizer.iterations) == int(ref_optimizer.iterations) == 9


def _numbered(strategy, n):
    batches = [np.full(4, float(i), "float32") for i in range(n)]
    return strategy.experimental_distribute_dataset(batches)


def _first(strategy, value):
    return float(strategy.experimental_local_results(value)[0][0])


def test_a_for_loop_over_an_iterator_argument_runs_to_the_end_as_tfs():
    # TF's `for batch in iterator:` inside the function: read to the end of the data.
    # The trace's stand-in elements never end, so the loop runs as Python (it hung).
    strategy = kd.MirroredStrategy(cpus(2))
    total = _summed_into(strategy)

    @kd.function
    def train_epoch(iterator):
        for batch in iterator:
            strategy.run(lambda x: total.assign_add(keras.ops.sum(x)), args=(batch,))

    train_epoch(iter(_numbered(strategy, 10)))
    assert float(total.value) == 4.0 * sum(range(10))  # TF 2.21: the same


def test_an_error_in_the_body_loses_no_element_read_for_the_call():
    strategy = kd.MirroredStrategy(cpus(2))

    @kd.function
    def two_steps(iterator, fail):
        values = []
        for i in range(2):
            values.append(strategy.run(lambda x: x * 1.0, args=(next(iterator),)))
            if fail and i == 1:
                raise ValueError("a bug in the step")
        return values

    iterator = iter(_numbered(strategy, 8))
    assert [_first(strategy, v) for v in two_steps(iterator, False)] == [0.0, 1.0]
    with pytest.raises(ValueError, match="a bug"):
        two_steps(iterator, True)
    # TF 2.21 reads nothing while it traces: the next call gets elements 2 and 3.
    assert [_first(strategy, v) for v in two_steps(iterator, False)] == [2.0, 3.0]


def test_one_iterator_in_two_arguments_is_read_in_call_order():
    strategy = kd.MirroredStrategy(cpus(2))

    def four_steps(a, b):
        return [strategy.run(lambda x: x * 1.0, args=(next(it),)) for it in (a, b, a, b)]

    iterator = iter(_numbered(strategy, 8))
    values = kd.function(four_steps)(iterator, iterator)
    assert [_first(strategy, v) for v in values] == [0.0, 1.0, 2.0, 3.0]


def test_a_python_generator_argument_runs_as_python_with_each_calls_elements():
    # A program would keep what its trace read; the trace's refusal to read the data
    # also ended the generator (EndOfInput on the first call).
    strategy = kd.MirroredStrategy(cpus(2))

    @kd.function
    def two_steps(batches):
        return [strategy.run(lambda x: x * 1.0, args=(next(batches),)) for _ in range(2)]

    generator = (batch for batch in _numbered(strategy, 6))
    firsts = [[_first(strategy, v) for v in two_steps(generator)] for _ in range(3)]
    assert firsts == [[0.0, 1.0], [2.0, 3.0], [4.0, 5.0]]


def test_more_steps_a_call_than_unrolled_run_as_python_with_the_same_values():
    strategy = kd.MirroredStrategy(cpus(2))
    with strategy.scope():
        total = keras.Variable(0.0, aggregation="sum")
    data = [np.full(2, float(i), "float32") for i in range(120)]
    iterator = iter(strategy.experimental_distribute_dataset(data))

    @kd.function
    def add_steps(iterator, steps):
        for _ in range(steps):
            strategy.run(lambda x: total.assign_add(keras.ops.sum(x)), args=(next(iterator),))
        return total.value

    assert float(add_steps(iterator, 101)) == 2.0 * sum(range(101))
    assert add_steps.experimental_get_tracing_count() == 0  # 101 steps would be unrolled
    assert float(add_steps(iterator, 19)) == 2.0 * sum(range(120))
    assert add_steps.experimental_get_tracing_count() == 1  # other counts still compile
