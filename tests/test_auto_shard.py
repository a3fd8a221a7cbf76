"""Auto-sharding between input pipelines, with TF's policies (spec §G 54)."""

import numpy as np
import pytest

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
