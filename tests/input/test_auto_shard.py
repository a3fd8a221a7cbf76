"""Auto-sharding between input pipelines, with TF's policies."""

import keras
import numpy as np
import pytest
from conftest import cpus

import keras_dist as kd
from keras_dist.data import AutoShardPolicy


def _files(num_files=10, records=10):
    data = {f"file{f}": [(f, r) for r in range(records)] for f in range(num_files)}
    return kd.data.FileDataset(list(data), reader=lambda path: data[path])


def _shard(dataset, policy, num_shards, index):
    dataset = kd.data.with_auto_shard_policy(dataset, policy)
    return list(kd.data.auto_shard(dataset, num_shards=num_shards, index=index))


@pytest.mark.parametrize("policy", [AutoShardPolicy.FILE, AutoShardPolicy.AUTO])
def test_file_policy_gives_each_worker_its_files(policy):
    # Spec 54: 10 files x 10 records, 5 shards: index 0 reads files 0 and 5.
    assert _shard(_files(), policy, 5, 0) == [(f, r) for f in (0, 5) for r in range(10)]
    assert _shard(_files(), policy, 5, 3) == [(f, r) for f in (3, 8) for r in range(10)]


def test_data_policy_keeps_every_nth_record():
    assert _shard(_files(), AutoShardPolicy.DATA, 5, 0) == [
        (f, r) for f in range(10) for r in (0, 5)
    ]
    # range(4) on 2 shards: index 0 -> [0, 2]; the shards are disjoint and complete.
    shards = [_shard(range(4), "DATA", 2, i) for i in range(2)]
    assert shards == [[0, 2], [1, 3]]


def test_off_policy_gives_everything():
    assert len(_shard(_files(), AutoShardPolicy.OFF, 5, 2)) == 100
    assert _shard(range(4), "OFF", 2, 1) == [0, 1, 2, 3]


def test_file_policy_needs_files():
    with pytest.raises(ValueError, match="not file-based"):
        _shard(range(4), AutoShardPolicy.FILE, 2, 0)
    with pytest.raises(ValueError, match="only has 10 file"):
        _shard(_files(), AutoShardPolicy.FILE, 500, 499)


def test_auto_falls_back_to_data_with_a_warning():
    with pytest.warns(UserWarning, match="falling back to DATA"):
        assert _shard(range(6), AutoShardPolicy.AUTO, 3, 1) == [1, 4]
    with pytest.warns(UserWarning, match="falling back to DATA"):
        assert _shard(_files(num_files=2), AutoShardPolicy.AUTO, 4, 0) == [
            (0, 0),
            (0, 4),
            (0, 8),
            (1, 2),
            (1, 6),
        ]


def test_auto_shard_through_input_contexts_of_several_pipelines():
    # Two input pipelines (workers) in one process: each shards, then batches.
    dataset = kd.data.with_auto_shard_policy(range(8), "DATA")
    contexts = [kd.InputContext(2, i, 2) for i in range(2)]
    shards = [list(kd.data.auto_shard(dataset, ctx)) for ctx in contexts]
    assert shards == [[0, 2, 4, 6], [1, 3, 5, 7]]
    batched = [[np.asarray(s[i : i + 3]).tolist() for i in range(0, len(s), 3)] for s in shards]
    assert batched == [[[0, 2, 4], [6]], [[1, 3, 5], [7]]]
    with pytest.raises(ValueError, match="Received: num_shards=2, index=2"):
        kd.data.auto_shard(dataset, num_shards=2, index=2)


def _range_batches(stop, size):
    return [np.arange(start, min(start + size, stop)) for start in range(0, stop, size)]


def test_spec_52_simulated_on_two_pipelines():
    # AUTO on range(4) (not file-based: DATA) -> w0 [0],[2] and w1 [1],[3]; OFF -> all.
    dataset = kd.data.with_auto_shard_policy(range(4), "AUTO")
    with pytest.warns(UserWarning, match="falling back to DATA"):
        shards = [list(kd.data.auto_shard(dataset, kd.InputContext(2, i, 2))) for i in (0, 1)]
    assert shards == [[0, 2], [1, 3]]
    off = kd.data.with_auto_shard_policy(range(4), "OFF")
    assert [list(kd.data.auto_shard(off, kd.InputContext(2, i, 2))) for i in (0, 1)] == [
        [0, 1, 2, 3]
    ] * 2


def test_spec_52_global_batches_split_between_two_replicas():
    # DATA with range(8).batch(3) across 2 workers: w0 [0,1],[3,4],[6]; w1 [2],[5],[7].
    # A global batch splits between replicas exactly as TF rebatches it between workers.
    from conftest import cpus

    strategy = kd.MirroredStrategy(cpus(2))
    steps = [
        [v.tolist() for v in strategy.experimental_local_results(batch)]
        for batch in strategy.experimental_distribute_dataset(_range_batches(8, 3))
    ]
    assert steps == [[[0, 1], [2]], [[3, 4], [5]], [[6], [7]]]


def test_spec_53_pipelines_of_different_lengths():
    # Pipeline 0 reads range(8).batch(2), pipeline 1 range(9).batch(2): the last
    # step gives w0 [] and w1 [8].
    from conftest import cpus

    strategy = kd.MirroredStrategy(cpus(2))
    options = kd.InputOptions(experimental_replication_mode=kd.InputReplicationMode.PER_REPLICA)
    dataset = strategy.distribute_datasets_from_function(
        lambda ctx: _range_batches(8 + ctx.input_pipeline_id, 2), options
    )
    steps = [[v.tolist() for v in strategy.experimental_local_results(b)] for b in dataset]
    assert steps[-1] == [[], [8]]
    assert len(steps) == 5


@pytest.mark.parametrize("policy", ["OFF", "DATA", "AUTO"])
def test_fit_on_one_worker_takes_a_dataset_with_a_policy(policy):
    # One worker reads all of the data whatever the policy: fit trains as on the data
    # itself (before, Keras refused the wrapper: "Unrecognized data type").
    rng = np.random.default_rng(0)
    x = rng.normal(size=(32, 3)).astype("float32")
    batches = [(x[i : i + 8], x[i : i + 8].sum(axis=1, keepdims=True)) for i in range(0, 32, 8)]
    histories = []
    for wrap in (True, False):
        strategy = kd.MirroredStrategy(cpus(2))
        keras.utils.set_random_seed(1)
        with strategy.scope():
            model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
            model.compile("sgd", "mse")
        data = (b for b in batches)
        if wrap:
            data = kd.data.with_auto_shard_policy(data, policy)
        histories.append(model.fit(data, epochs=1, verbose=0).history["loss"])
    assert histories[0] == histories[1]
    assert len(histories[0]) == 1 and histories[0][0] > 0


@pytest.mark.parametrize("policy", ["OFF", "DATA", "AUTO", None])
def test_fit_takes_a_numpy_dataset_with_a_policy(policy):
    # strategy.experimental_make_numpy_dataset(...).batch(n), the docs' tf.data stand-in,
    # with a policy attached (Keras refused it: "Unrecognized data type").
    rng = np.random.default_rng(0)
    x = rng.normal(size=(32, 3)).astype("float32")
    y = x.sum(axis=1, keepdims=True)
    strategy = kd.MirroredStrategy(cpus(2))
    losses = []
    for data in ((x, y), strategy.experimental_make_numpy_dataset((x, y)).batch(8)):
        if policy is not None and not isinstance(data, tuple):
            data = kd.data.with_auto_shard_policy(data, policy)
        keras.utils.set_random_seed(1)
        with strategy.scope():
            model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
            model.compile("sgd", "mse")
        if isinstance(data, tuple):
            history = model.fit(*data, batch_size=8, shuffle=False, epochs=2, verbose=0)
        else:
            history = model.fit(data, epochs=2, verbose=0)
        losses.append(history.history["loss"])
    np.testing.assert_allclose(losses[1], losses[0], rtol=1e-6)
