"""Distributed input: experimental_distribute_dataset, distribute_datasets_from_function,
the distributed iterator, InputContext and InputOptions.

Expected values are TF's (its input_lib and distribute_datasets tests), taken as formulas of
the replica count ``n`` where TF's tests give them for two replicas.
"""

import jax.numpy as jnp
import keras
import numpy as np
import pytest
from conftest import cpus

import keras_dist as kd

REPLICAS = [1, 2, 4]


def _batches(size, batch_size, drop_remainder=False, dtype="int32"):
    """``range(size)`` batched by ``batch_size``, as a list of NumPy arrays."""
    stop = size - size % batch_size if drop_remainder else size
    return [
        np.arange(start, min(start + batch_size, stop), dtype=dtype)
        for start in range(0, stop, batch_size)
    ]


def _local(strategy, value):
    """The local components of ``value`` as Python lists, in replica order."""
    return [np.asarray(c).tolist() for c in strategy.experimental_local_results(value)]


def _epoch(strategy, dataset):
    return [_local(strategy, element) for element in dataset]


def _split(rows, n):
    """How TF splits a global batch between ``n`` replicas: ceil(rows / n) each, in order."""
    rows = list(rows)
    each = -(-len(rows) // n)
    return [rows[i * each : (i + 1) * each] for i in range(n)]


def _in_steps(batches, n):
    """Per-replica batches taken ``n`` at a time; a short last step gets empty batches."""
    steps = []
    for start in range(0, len(batches), n):
        step = [np.asarray(b).tolist() for b in batches[start : start + n]]
        steps.append(step + [[]] * (n - len(step)))
    return steps


# ------------------------------------------------- experimental_distribute_dataset


@pytest.mark.parametrize(
    "n, expected",
    [
        (1, [[[i, i + 1]] for i in range(0, 10, 2)]),
        (2, [[[i], [i + 1]] for i in range(0, 10, 2)]),
        (4, [[[i], [i + 1], [], []] for i in range(0, 10, 2)]),
    ],
)
def test_distribute_dataset_rebatches_global_batches(n, expected):
    # Spec 43: range(10).batch(2) → n=2 [[0],[1]], [[2],[3]], ...; n=1 [[0,1]], ...
    strategy = kd.MirroredStrategy(cpus(n))
    dataset = strategy.experimental_distribute_dataset(_batches(10, 2))
    assert _epoch(strategy, dataset) == expected


@pytest.mark.parametrize("n", REPLICAS)
def test_batch_splitting(n):
    # Spec 44: range(100).batch(10) → [range(i, i+5), range(i+5, i+10)] per step on 2
    # replicas; in general each replica takes its consecutive share of the rows.
    strategy = kd.MirroredStrategy(cpus(n))
    epoch = _epoch(strategy, strategy.experimental_distribute_dataset(_batches(100, 10)))
    assert epoch == [_split(range(i, i + 10), n) for i in range(0, 100, 10)]
    if n == 2:
        assert epoch[3] == [list(range(30, 35)), list(range(35, 40))]
    if n == 4:
        # 10 rows on 4 replicas: ceil(10 / 4) = 3 each until the rows run out (TF 2.21).
        assert [len(part) for part in epoch[0]] == [3, 3, 3, 1]


@pytest.mark.parametrize(
    "rows, n, expected",
    [
        (5, 4, [[0, 1], [2, 3], [4], []]),
        (1, 2, [[0], []]),
        (3, 4, [[0], [1], [2], []]),
        (1, 4, [[0], [], [], []]),
        (4, 4, [[0], [1], [2], [3]]),
    ],
)
def test_partial_batch_split_as_tf_splits_it(rows, n, expected):
    strategy = kd.MirroredStrategy(cpus(n))
    dataset = strategy.experimental_distribute_dataset([np.arange(rows)])
    assert _epoch(strategy, dataset) == [expected]


def test_partial_batch_splits_every_leaf_of_a_nest_alike():
    strategy = kd.MirroredStrategy(cpus(4))
    features = np.arange(15.0).reshape(5, 3)
    batch = ({"a": np.arange(5), "b": features}, np.arange(10, 15))
    (element,) = list(strategy.experimental_distribute_dataset([batch]))
    inputs, labels = element
    assert _local(strategy, inputs["a"]) == [[0, 1], [2, 3], [4], []]
    assert _local(strategy, labels) == [[10, 11], [12, 13], [14], []]
    assert _local(strategy, inputs["b"]) == [
        features[:2].tolist(),
        features[2:4].tolist(),
        features[4:].tolist(),
        features[:0].tolist(),
    ]


@pytest.mark.parametrize("n", REPLICAS)
def test_partial_last_batch_through_run_and_reduce(engine, n):
    # range(11).batch(4): the last global batch [8, 9, 10] is split unevenly (n > 1),
    # which the eager engine runs; reductions count every real row exactly once.
    strategy = kd.MirroredStrategy(cpus(n))
    dataset = strategy.experimental_distribute_dataset(_batches(11, 4, dtype="float32"))
    totals, means, last = [], [], None
    for x in dataset:
        last = strategy.run(lambda x: x * 2.0, args=(x,))
        totals.append(float(strategy.reduce("SUM", last, axis=0)))
        means.append(float(strategy.reduce("MEAN", last, axis=0)))
    assert _local(strategy, last) == _split([16.0, 18.0, 20.0], n)
    assert totals == [12.0, 44.0, 54.0]
    assert means == [3.0, 11.0, 18.0]
    assert sum(totals) == 2 * sum(range(11))


def test_one_row_on_two_replicas_through_run_and_reduce(engine):
    strategy = kd.MirroredStrategy(cpus(2))
    (x,) = list(strategy.experimental_distribute_dataset([np.array([7.0], "float32")]))
    assert _local(strategy, x) == [[7.0], []]
    out = strategy.run(lambda x: x * 2.0, args=(x,))
    assert _local(strategy, out) == [[14.0], []]
    assert float(strategy.reduce("SUM", out, axis=0)) == 14.0
    assert float(strategy.reduce("MEAN", out, axis=0)) == 14.0


def test_one_shot_iterator_is_rejected():
    strategy = kd.MirroredStrategy(cpus(2))
    generator = (b for b in _batches(10, 2))
    with pytest.raises(ValueError, match=r"re-iterable.*Received: generator"):
        strategy.experimental_distribute_dataset(generator)
    with pytest.raises(ValueError, match=r"one-shot iterator.*Received: list_iterator"):
        strategy.experimental_distribute_dataset(iter(_batches(10, 2)))
    with pytest.raises(ValueError, match=r"re-iterable.*Received: generator"):
        strategy.distribute_datasets_from_function(lambda ctx: (b for b in _batches(9, 2)))
    # `from_generator(gen)`'s argument, the generator function: what to pass instead.
    with pytest.raises(TypeError, match=r"`__iter__` calls `gen\(\)`.*Received: <function"):
        strategy.experimental_distribute_dataset(lambda: (b for b in _batches(10, 2)))


def test_arrays_given_for_a_dataset_are_refused_with_what_to_pass():
    # Read as batches, `(x, y)` would be two batches and an array's rows would each be
    # split between the replicas; TF refuses both too.
    strategy = kd.MirroredStrategy(cpus(2))
    x, y = np.arange(20.0).reshape(10, 2), np.arange(10.0)
    for given, received in [
        ((x, y), r"a tuple of arrays of shapes \(\(10, 2\), \(10,\)\)"),
        (x, r"an array of shape \(10, 2\)"),
        ({"x": x}, r"a dict of arrays of shapes \{'x': \(10, 2\)\}"),
    ]:
        with pytest.raises(TypeError, match=r"experimental_make_numpy_dataset.*" + received):
            strategy.experimental_distribute_dataset(given)
    # What the message says to do gives the global batches split between the replicas.
    batches = strategy.experimental_make_numpy_dataset((x, y)).batch(4)
    first_x, first_y = next(iter(strategy.experimental_distribute_dataset(batches)))
    assert _local(strategy, first_y) == [[0.0, 1.0], [2.0, 3.0]]
    assert [v.shape for v in strategy.experimental_local_results(first_x)] == [(2, 2), (2, 2)]


@pytest.mark.parametrize(
    "batch, match",
    [
        ((np.arange(4), np.arange(3)), r"same leading .*Received: shapes=\[\(4,\), \(3,\)\]"),
        ({"x": np.float32(1.0)}, r"same leading .*Received: shapes=\[\(\)\]"),
    ],
)
def test_batch_without_a_common_leading_dimension_raises(batch, match):
    strategy = kd.MirroredStrategy(cpus(2))
    iterator = iter(strategy.experimental_distribute_dataset([batch]))
    with pytest.raises(ValueError, match=match):
        next(iterator)


def test_get_next_inside_run_raises(engine):
    # Spec 43: next(iterator) inside the replica function raises ValueError.
    strategy = kd.MirroredStrategy(cpus(2))
    iterator = iter(strategy.experimental_distribute_dataset(_batches(10, 2)))
    with pytest.raises(ValueError, match=r"outside of replica_fn.*Received:"):
        strategy.run(lambda it: next(it), args=(iterator,))
    # The iterator is untouched and still works in cross-replica context.
    assert _local(strategy, iterator.get_next()) == [[0], [1]]


@pytest.mark.parametrize("n", REPLICAS)
def test_static_shapes_and_get_next_as_optional(engine, n):
    # Spec 47: a batch of 8 gives per-replica shapes [8/n, 10] and [8/n]; at the end
    # has_value() is False.
    strategy = kd.MirroredStrategy(cpus(n))
    numpy_dataset = strategy.experimental_make_numpy_dataset(
        {"feature": np.ones((20, 10), "float32"), "label": np.ones(20, "float32")}
    )
    dataset = strategy.experimental_distribute_dataset(numpy_dataset.batch(8, drop_remainder=True))
    iterator = iter(dataset)
    expected = ((8 // n, 10), (8 // n,))
    seen = []

    def step(data):
        seen.append((tuple(data["feature"].shape), tuple(data["label"].shape)))
        return keras.ops.sum(data["label"])

    label_sums = []
    while True:
        optional = iterator.get_next_as_optional()
        if not optional.has_value():
            break
        per_replica = strategy.run(step, args=(optional.get_value(),))
        label_sums.append(float(strategy.reduce("SUM", per_replica)))
    assert label_sums == [8.0, 8.0]  # drop_remainder: 20 rows give two batches of 8
    assert set(seen) == {expected}
    spec = iterator.element_spec
    assert (spec["feature"].shape, spec["label"].shape) == expected
    assert spec["feature"].dtype == np.float32
    assert not iterator.get_next_as_optional().has_value()
    with pytest.raises(ValueError, match="no value"):
        iterator.get_next_as_optional().get_value()
    with pytest.raises(StopIteration):
        iterator.get_next()


def test_element_spec_of_empty_data_is_none():
    strategy = kd.MirroredStrategy(cpus(2))
    dataset = strategy.experimental_distribute_dataset([])
    assert dataset.element_spec is None  # a bare StopIteration came out of the property
    assert iter(dataset).element_spec is None


def test_element_spec_known_before_the_first_element():
    strategy = kd.MirroredStrategy(cpus(2))
    dataset = strategy.experimental_distribute_dataset(
        [(np.zeros((4, 3), "float32"), np.arange(4, dtype="int32"))] * 2
    )
    features, labels = dataset.element_spec
    assert (features.shape, features.dtype, labels.shape, labels.dtype) == (
        (2, 3),
        np.float32,
        (2,),
        np.int32,
    )
    iterator = iter(dataset)
    assert iterator.element_spec[0].shape == (2, 3)
    # Reading the spec does not consume an element.
    assert len(list(iterator)) == 2
    assert iter(strategy.experimental_distribute_dataset([])).element_spec is None


@pytest.mark.parametrize("n", REPLICAS)
def test_reiteration_gives_equal_epochs(n):
    # Spec 49: a deterministic source gives equal epochs; each iter() starts again.
    strategy = kd.MirroredStrategy(cpus(n))
    dataset = strategy.experimental_distribute_dataset(_batches(20, 4))
    first, second = _epoch(strategy, dataset), _epoch(strategy, dataset)
    assert first == second == [_split(range(i, i + 4), n) for i in range(0, 20, 4)]
    a, b = iter(dataset), iter(dataset)
    assert _local(strategy, next(a)) == _local(strategy, next(b)) == _split(range(4), n)

    from_fn = strategy.distribute_datasets_from_function(lambda ctx: _batches(9, 2))
    assert _epoch(strategy, from_fn) == _epoch(strategy, from_fn) == _in_steps(_batches(9, 2), n)


class _Reshuffled:
    """A re-iterable that shuffles its rows again on every iteration."""

    def __init__(self):
        self.epochs = 0

    def __iter__(self):
        self.epochs += 1
        rows = np.random.default_rng(self.epochs).permutation(16)
        return iter(np.split(rows, 4))


def test_reshuffling_source_gives_a_new_order_each_epoch():
    # Spec 49: reshuffle_each_iteration=True → epochs differ: every epoch re-reads the
    # source instead of replaying the first.
    strategy = kd.MirroredStrategy(cpus(2))
    source = _Reshuffled()
    dataset = strategy.experimental_distribute_dataset(source)
    first, second = _epoch(strategy, dataset), _epoch(strategy, dataset)
    assert source.epochs == 2  # one iteration per epoch, none to check the source
    assert first != second
    flat = lambda epoch: sorted(x for step in epoch for part in step for x in part)
    assert flat(first) == flat(second) == list(range(16))


# ---------------------------------------------------------------- numpy dataset


@pytest.mark.parametrize("n", [1, 2])
def test_fit_reads_a_batched_numpy_dataset_as_tf_reads_from_tensor_slices(n):
    # TF 2.21: fit on from_tensor_slices((x, y)).batch(10) of 100 rows of ones, weights
    # [[0.5]], [0], SGD: loss [0.17793291807174683, 0.07864677160978317]. Keras refused
    # the NumPy dataset ("Unrecognized data type").
    strategy = kd.MirroredStrategy(cpus(n))
    with strategy.scope():
        model = keras.Sequential([keras.Input((1,)), keras.layers.Dense(1)])
        model.compile(loss="mse", optimizer="sgd")
    model.set_weights([np.array([[0.5]], "float32"), np.array([0.0], "float32")])
    ones = np.ones((100, 1), "float32")
    dataset = strategy.experimental_make_numpy_dataset((ones, ones)).batch(10)
    history = model.fit(dataset, epochs=2, verbose=0).history["loss"]
    np.testing.assert_allclose(history, [0.17793291807174683, 0.07864677160978317], rtol=1e-6)
    assert model.evaluate(dataset, verbose=0) < history[-1]
    with pytest.raises(ValueError, match=r"call `\.batch\(n\)`.*Received: an unbatched"):
        model.fit(strategy.experimental_make_numpy_dataset((ones, ones)), verbose=0)


def test_make_numpy_dataset_batches_and_distributes():
    strategy = kd.MirroredStrategy(cpus(2))
    numpy_dataset = strategy.experimental_make_numpy_dataset(np.arange(5))
    batched = numpy_dataset.batch(2)
    assert [b.tolist() for b in batched] == [[0, 1], [2, 3], [4]]
    assert [b.tolist() for b in batched] == [[0, 1], [2, 3], [4]]  # re-iterable
    assert len(batched) == 3
    assert [b.tolist() for b in numpy_dataset.batch(2, drop_remainder=True)] == [[0, 1], [2, 3]]
    dataset = strategy.experimental_distribute_dataset(batched)
    assert _epoch(strategy, dataset) == [[[0], [1]], [[2], [3]], [[4], []]]

    pairs = strategy.experimental_make_numpy_dataset((np.arange(4), np.arange(4) * 10)).batch(4)
    ((x, y),) = list(strategy.experimental_distribute_dataset(pairs))
    assert _local(strategy, x) == [[0, 1], [2, 3]]
    assert _local(strategy, y) == [[0, 10], [20, 30]]


# ------------------------------------------------------ distribute_datasets_from_function


@pytest.mark.parametrize("drop_remainder", [False, True])
@pytest.mark.parametrize("n", REPLICAS)
def test_dataset_from_function_uneven_batches(n, drop_remainder):
    # Spec 45: per-replica batches, no rebatching. range(9).batch(2) on 2 replicas →
    # [[0,1],[2,3]], [[4,5],[6,7]], [[8],[]]; drop_remainder keeps the first two.
    strategy = kd.MirroredStrategy(cpus(n))
    per_replica = _batches(9, 2, drop_remainder)
    dataset = strategy.distribute_datasets_from_function(lambda ctx: per_replica)
    expected = _in_steps(per_replica, n)
    if n == 2:
        assert (
            expected
            == [[[0, 1], [2, 3]], [[4, 5], [6, 7]], [[8], []]][: 2 if drop_remainder else 3]
        )
    iterator = iter(dataset)
    assert [_local(strategy, iterator.get_next()) for _ in expected] == expected
    with pytest.raises(StopIteration):
        iterator.get_next()
    assert not iterator.get_next_as_optional().has_value()
    # iter() again restarts from the beginning.
    assert _epoch(strategy, dataset) == expected


def test_deprecated_experimental_name_distributes_the_same_and_warns():
    # TF keeps experimental_distribute_datasets_from_function as a deprecated alias.
    strategy = kd.MirroredStrategy(cpus(2))
    per_replica = _batches(9, 2)
    with pytest.warns(DeprecationWarning, match="rename it to `distribute_datasets_from_function`"):
        old = strategy.experimental_distribute_datasets_from_function(lambda ctx: per_replica)
    new = strategy.distribute_datasets_from_function(lambda ctx: per_replica)
    assert _epoch(strategy, old) == _epoch(strategy, new) == _in_steps(per_replica, 2)


def test_dataset_from_function_empty_batches_keep_dtype_and_trailing_shape():
    strategy = kd.MirroredStrategy(cpus(4))
    batches = [(np.ones((2, 3), "float32"), np.arange(2, dtype="int32"))] * 5
    dataset = strategy.distribute_datasets_from_function(lambda ctx: batches)
    *_, (features, labels) = list(dataset)
    shapes = [np.shape(c) for c in strategy.experimental_local_results(features)]
    assert shapes == [(2, 3), (0, 3), (0, 3), (0, 3)]
    assert {np.asarray(c).dtype for c in strategy.experimental_local_results(labels)} == {
        np.dtype("int32")
    }


@pytest.mark.parametrize(
    "make_dataset, expected",
    [
        # TF 2.21, 4 replicas: range(22).batch(2, drop_remainder=True) gives 2 steps (its
        # 11th batch does not make a third); range(6) gives [0, 1, 2, 3] and stops;
        # from_tensor_slices of 9 rows of 2 gives 2 steps.
        (
            lambda np_dataset: np_dataset(np.arange(22)).batch(2, drop_remainder=True),
            [[[0, 1], [2, 3], [4, 5], [6, 7]], [[8, 9], [10, 11], [12, 13], [14, 15]]],
        ),
        (lambda np_dataset: np_dataset(np.arange(6)), [[0, 1, 2, 3]]),
        (lambda np_dataset: [np.int32(i) for i in range(6)], [[0, 1, 2, 3]]),
        (
            lambda np_dataset: np_dataset(np.arange(18).reshape(9, 2)),
            [[[0, 1], [2, 3], [4, 5], [6, 7]], [[8, 9], [10, 11], [12, 13], [14, 15]]],
        ),
        (
            lambda np_dataset: np_dataset((np.arange(9), 10 * np.arange(9))),
            [[[0, 0], [1, 10], [2, 20], [3, 30]], [[4, 40], [5, 50], [6, 60], [7, 70]]],
        ),
        # Batches of unknown size (no drop_remainder): the short round is kept, with
        # empty batches, as TF's partial-batch handling does.
        (
            lambda np_dataset: np_dataset(np.arange(22)).batch(2),
            [[[0, 1], [2, 3], [4, 5], [6, 7]], [[8, 9], [10, 11], [12, 13], [14, 15]]]
            + [[[16, 17], [18, 19], [20, 21], []]],
        ),
    ],
)
def test_dataset_from_function_with_static_shapes_ends_at_the_first_short_round(
    make_dataset, expected
):
    strategy = kd.MirroredStrategy(cpus(4))
    dataset = strategy.distribute_datasets_from_function(
        lambda ctx: make_dataset(strategy.experimental_make_numpy_dataset)
    )
    steps = [[np.asarray(v).tolist() for v in _local_nest(strategy, x)] for x in dataset]
    assert steps == expected


def _local_nest(strategy, element):
    """Each replica's part of an element (a tuple element becomes one list per replica)."""
    leaves = element if isinstance(element, tuple) else (element,)
    parts = [strategy.experimental_local_results(x) for x in leaves]
    return [np.stack(p) if len(p) > 1 else p[0] for p in zip(*parts)]


@pytest.mark.parametrize("drop_remainder", [False, True])
def test_per_replica_pipelines_with_static_shapes_end_together(drop_remainder):
    # TF 2.21, PER_REPLICA, replica r reads range(2 (r + 1)).batch(2, drop_remainder):
    # static shapes give one step; otherwise replicas that ran out get empty batches.
    strategy = kd.MirroredStrategy(cpus(4))
    options = kd.InputOptions(experimental_replication_mode=kd.InputReplicationMode.PER_REPLICA)
    dataset = strategy.distribute_datasets_from_function(
        lambda ctx: strategy.experimental_make_numpy_dataset(
            np.arange(2 * (ctx.input_pipeline_id + 1))
        ).batch(2, drop_remainder=drop_remainder),
        options,
    )
    expected = [
        [[0, 1], [0, 1], [0, 1], [0, 1]],
        [[], [2, 3], [2, 3], [2, 3]],
        [[], [], [4, 5], [4, 5]],
        [[], [], [], [6, 7]],
    ]
    assert _epoch(strategy, dataset) == expected[: 1 if drop_remainder else 4]


@pytest.mark.parametrize("n", REPLICAS)
def test_input_context_given_to_dataset_fn(n):
    # Spec 46: Mirrored with 2 devices → (n=2, 1 pipeline, id 0); OneDevice → (1, 1, 0).
    contexts = []

    def dataset_fn(ctx):
        contexts.append((ctx.num_replicas_in_sync, ctx.num_input_pipelines, ctx.input_pipeline_id))
        return _batches(4, 2)

    kd.MirroredStrategy(cpus(n)).distribute_datasets_from_function(dataset_fn)
    assert contexts == [(n, 1, 0)]

    contexts.clear()
    options = kd.InputOptions(experimental_replication_mode=kd.InputReplicationMode.PER_REPLICA)
    kd.MirroredStrategy(cpus(n)).distribute_datasets_from_function(dataset_fn, options)
    assert contexts == [(n, n, i) for i in range(n)]


@pytest.mark.parametrize("make_strategy", [lambda: kd.OneDeviceStrategy("/cpu:0"), kd.get_strategy])
def test_input_context_on_one_replica(make_strategy):
    contexts = []

    def dataset_fn(ctx):
        contexts.append((ctx.num_replicas_in_sync, ctx.num_input_pipelines, ctx.input_pipeline_id))
        return _batches(4, 2)

    make_strategy().distribute_datasets_from_function(dataset_fn)
    assert contexts == [(1, 1, 0)]


def test_per_worker_values():
    # Spec 55: PER_WORKER with arange(1,11).reshape(2,5)·(pid+1): replica0 [1..5],
    # replica1 [6..10].
    strategy = kd.MirroredStrategy(cpus(2))
    options = kd.InputOptions(experimental_replication_mode=kd.InputReplicationMode.PER_WORKER)
    dataset = strategy.distribute_datasets_from_function(
        lambda ctx: np.arange(1, 11).reshape(2, 5) * (ctx.input_pipeline_id + 1), options
    )
    iterator = iter(dataset)
    assert _local(strategy, next(iterator)) == [[1, 2, 3, 4, 5], [6, 7, 8, 9, 10]]
    with pytest.raises(StopIteration):
        next(iterator)


@pytest.mark.parametrize("place_on_device", [False, True])
@pytest.mark.parametrize("n", REPLICAS)
def test_per_replica_values(n, place_on_device):
    # Spec 55: PER_REPLICA with arange(1,10)·(r+1): step i gives values[r] = i·(r+1),
    # for 9 steps. place_dataset_on_device is allowed with PER_REPLICA.
    strategy = kd.MirroredStrategy(cpus(n))
    options = kd.InputOptions(
        experimental_replication_mode=kd.InputReplicationMode.PER_REPLICA,
        experimental_place_dataset_on_device=place_on_device,
        experimental_fetch_to_device=not place_on_device,
    )
    dataset = strategy.distribute_datasets_from_function(
        lambda ctx: np.arange(1, 10) * (ctx.input_pipeline_id + 1), options
    )
    epoch = _epoch(strategy, dataset)
    assert epoch == [[i * (r + 1) for r in range(n)] for i in range(1, 10)]
    if n == 2:
        assert [step[0] for step in epoch] == list(range(1, 10))
        assert [step[1] for step in epoch] == [2 * i for i in range(1, 10)]


def test_per_replica_pipelines_that_run_out_give_empty_batches(engine):
    # Replica r's pipeline has r + 1 batches: a replica whose data ended gets an empty
    # batch until every pipeline has ended.
    strategy = kd.MirroredStrategy(cpus(4))
    options = kd.InputOptions(experimental_replication_mode=kd.InputReplicationMode.PER_REPLICA)
    dataset = strategy.distribute_datasets_from_function(
        lambda ctx: [np.full(2, ctx.input_pipeline_id, "float32")] * (ctx.input_pipeline_id + 1),
        options,
    )
    steps = _epoch(strategy, dataset)
    assert steps == [
        [[0, 0], [1, 1], [2, 2], [3, 3]],
        [[], [1, 1], [2, 2], [3, 3]],
        [[], [], [2, 2], [3, 3]],
        [[], [], [], [3, 3]],
    ]
    sums = [
        float(strategy.reduce("SUM", strategy.run(lambda x: x + 1.0, (x,)), axis=0))
        for x in dataset
    ]
    assert sums == [20.0, 18.0, 14.0, 8.0]


@pytest.mark.parametrize(
    "options, match",
    [
        (
            kd.InputOptions(
                experimental_replication_mode=kd.InputReplicationMode.PER_REPLICA,
                experimental_place_dataset_on_device=True,
                experimental_fetch_to_device=True,
            ),
            r"experimental_fetch_to_device=True.*Received: InputOptions",
        ),
        (
            kd.InputOptions(experimental_place_dataset_on_device=True),
            r"PER_REPLICA.*Received: InputOptions",
        ),
        (  # TF: fetch_to_device is True unless set, so placing on the device must turn it off.
            kd.InputOptions(
                experimental_replication_mode=kd.InputReplicationMode.PER_REPLICA,
                experimental_place_dataset_on_device=True,
            ),
            r"experimental_fetch_to_device=True.*Received: InputOptions",
        ),
        (
            kd.InputOptions(experimental_per_replica_buffer_size=-1),
            r"at least 0\. Received: -1",
        ),
    ],
)
def test_invalid_input_options_raise(options, match):
    # Spec 55: place_dataset_on_device with fetch_to_device=True, or with PER_WORKER,
    # raises ValueError, before dataset_fn is called.
    strategy = kd.MirroredStrategy(cpus(2))
    calls = []
    with pytest.raises(ValueError, match=match):
        strategy.distribute_datasets_from_function(
            lambda ctx: calls.append(ctx) or _batches(4, 2), options
        )
    assert calls == []


def test_distribute_dataset_ignores_the_placement_options():
    # TF 2.21: experimental_distribute_dataset does not check place_dataset_on_device
    # (only distribute_datasets_from_function does); range(8).batch(8) on 4 replicas.
    strategy = kd.MirroredStrategy(cpus(4))
    options = kd.InputOptions(experimental_place_dataset_on_device=True)
    dataset = strategy.experimental_distribute_dataset(_batches(8, 8), options)
    assert _epoch(strategy, dataset) == [[[0, 1], [2, 3], [4, 5], [6, 7]]]
    assert kd.InputOptions().experimental_fetch_to_device is True


def test_per_replica_mode_is_not_for_global_batches():
    strategy = kd.MirroredStrategy(cpus(2))
    options = kd.InputOptions(experimental_replication_mode=kd.InputReplicationMode.PER_REPLICA)
    with pytest.raises(NotImplementedError, match=r"distribute_datasets_from_function.*Received"):
        strategy.experimental_distribute_dataset(_batches(4, 2), options)


# --------------------------------------------------------- accumulating over a dataset


@pytest.mark.parametrize("synchronization", ["on_write", "on_read"])
@pytest.mark.parametrize("n", REPLICAS)
def test_sum_variable_accumulated_over_dataset(engine, n, synchronization):
    # Spec 56 (TF's testLoopOverDatasetInTFFunction): range(10) mapped to {"y": x²},
    # batch(4), accumulated into a SUM variable inside the replica function → 285.
    strategy = kd.MirroredStrategy(cpus(n))
    with strategy.scope():
        total = keras.Variable(0.0, synchronization=synchronization, aggregation="sum")
    expected_class = kd.SyncOnReadVariable if synchronization == "on_read" else kd.MirroredVariable
    assert isinstance(total, expected_class)
    batches = [{"y": b**2} for b in _batches(10, 4, dtype="float32")]
    dataset = strategy.experimental_distribute_dataset(batches)

    def step(data):
        total.assign_add(keras.ops.sum(data["y"]))

    for data in dataset:
        strategy.run(step, args=(data,))
    with strategy.scope():  # a SyncOnRead variable aggregates in cross-replica context
        assert float(total.value) == 285.0
    if synchronization == "on_write":
        assert float(total.value) == 285.0  # the same on every replica: readable anywhere


def test_one_device_strategy_dataset(engine):
    strategy = kd.OneDeviceStrategy("/cpu:0")
    dataset = strategy.experimental_distribute_dataset(_batches(10, 2, dtype="float32"))
    assert _epoch(strategy, dataset) == [[[i, i + 1]] for i in range(0, 10, 2)]
    with strategy.scope():
        total = keras.Variable(0.0, synchronization="on_read", aggregation="sum")
    for x in dataset:
        strategy.run(lambda x: total.assign_add(keras.ops.sum(x * x)), args=(x,))
    with strategy.scope():
        assert float(total.value) == 285.0


def test_default_strategy_dataset(engine):
    # Spec 56: default strategy, range(10).batch(2): the first element is [0, 1].
    strategy = kd.get_strategy()
    dataset = strategy.experimental_distribute_dataset(_batches(10, 2, dtype="float32"))
    iterator = iter(dataset)
    first = iterator.get_next()
    assert np.asarray(first).tolist() == [0.0, 1.0]
    assert [np.asarray(x).tolist() for x in strategy.experimental_local_results(first)] == [
        [0.0, 1.0]
    ]
    total = keras.Variable(0.0)
    for x in dataset:
        strategy.run(lambda x: total.assign_add(keras.ops.sum(x * x)), args=(x,))
    assert float(total.value) == 285.0

    from_fn = strategy.distribute_datasets_from_function(lambda ctx: _batches(9, 2))
    assert [np.asarray(x).tolist() for x in from_fn] == [b.tolist() for b in _batches(9, 2)]
    # A partial global batch stays whole on one replica.
    last = strategy.reduce("SUM", list(dataset)[-1], axis=0)
    assert float(last) == 17.0


@pytest.mark.parametrize("rows, sizes", [(178, [45, 45, 45, 43]), (10, [3, 3, 3, 1])])
def test_partial_batch_sizes_are_tf_221s(rows, sizes):
    strategy = kd.MirroredStrategy(cpus(4))
    dataset = strategy.experimental_distribute_dataset([np.arange(rows)])
    assert [len(part) for part in _epoch(strategy, dataset)[0]] == sizes


@pytest.mark.parametrize(
    "make_strategy",
    [lambda: kd.OneDeviceStrategy("/cpu:0"), lambda: kd.MirroredStrategy(cpus(1))],
    ids=["one_device", "mirrored_1"],
)
def test_one_replica_gets_each_batch_itself_as_in_tf(make_strategy):
    # TF 2.21: with one replica in sync, distributed datasets give the batches
    # themselves (EagerTensors), so `x.shape`, `x * 2` and `float(...)` work on them.
    strategy = make_strategy()
    x = np.arange(10, dtype="float32")
    for dataset in (
        strategy.experimental_distribute_dataset(
            strategy.experimental_make_numpy_dataset(x).batch(4)
        ),
        strategy.distribute_datasets_from_function(
            lambda context: strategy.experimental_make_numpy_dataset(x).batch(4)
        ),
    ):
        batches = list(dataset)
        assert not any(isinstance(b, kd.DistributedValues) for b in batches)
        assert [b.shape for b in batches] == [(4,), (4,), (2,)]
        assert float(jnp.sum(batches[-1] * 2)) == 34.0
        total = strategy.reduce(
            "SUM", strategy.run(lambda b: jnp.sum(b), args=(batches[0],)), axis=None
        )
        assert float(total) == 6.0
        assert dataset.element_spec.shape == (4,)


def test_one_device_values_from_function_is_the_value_itself_as_in_tf():
    strategy = kd.OneDeviceStrategy("/cpu:0")
    value = strategy.experimental_distribute_values_from_function(lambda ctx: np.ones(2) * 3)
    assert not isinstance(value, kd.DistributedValues)
    np.testing.assert_array_equal(np.asarray(value * 2), [6.0, 6.0])
    # A Mirrored strategy on one device keeps TF's PerReplica there.
    mirrored = kd.MirroredStrategy(cpus(1))
    per_replica = mirrored.experimental_distribute_values_from_function(lambda ctx: 1.0)
    assert isinstance(per_replica, kd.DistributedValues)


def test_a_pydatasets_on_epoch_end_follows_each_whole_pass():
    # The porting table's advice: reshuffle a PyDataset in `on_epoch_end`. Each whole
    # pass over a distributed dataset ends the source's epoch, as `fit` ends it.
    class Epochs(keras.utils.PyDataset):
        def __init__(self, batches=2):
            super().__init__()
            self.batches = batches
            self.ends = 0

        def __len__(self):
            return self.batches

        def __getitem__(self, index):
            return np.full((4, 1), index + 10 * self.ends, "float32")

        def on_epoch_end(self):
            self.ends += 1

    strategy = kd.MirroredStrategy(cpus(2))
    source = Epochs()
    dataset = strategy.experimental_distribute_dataset(source)
    firsts = []
    for _ in range(2):
        batches = list(dataset)
        firsts.append(float(np.asarray(strategy.experimental_local_results(batches[0])[0])[0, 0]))
    assert source.ends == 2 and firsts == [0.0, 10.0]  # the second pass read the new epoch
    # A pass left unfinished (the reader runs a batch or two ahead) ends no epoch.
    long_source = Epochs(batches=20)
    next(iter(strategy.experimental_distribute_dataset(long_source)))
    assert long_source.ends == 0
    per_worker = Epochs()
    list(strategy.distribute_datasets_from_function(lambda context: per_worker))
    assert per_worker.ends == 1
