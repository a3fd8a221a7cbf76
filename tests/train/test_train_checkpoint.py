"""kd.train: Checkpoint, CheckpointManager and latest_checkpoint, as tf.train's."""

import glob
import logging
import os
import queue
import random
import re
import subprocess
import sys
import threading
import time
import zipfile

import jax.numpy as jnp
import keras
import numpy as np
import pytest
from conftest import cpus

import keras_dist as kd
from keras_dist._values._variables import numpy_components
from keras_dist.cluster_resolver import ClusterSpec
from keras_dist.cluster_resolver._role import ProcessRole
from keras_dist.train import _objects

GLOBAL_BATCH = 8


def _batches(count, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(count, GLOBAL_BATCH, 4)).astype("float32")
    y = (x @ np.array([1.0, -2.0, 0.5, 3.0], "float32"))[..., None]
    return list(zip(x, y))


def _model_and_optimizer(strategy, seed=3):
    keras.utils.set_random_seed(seed)
    with strategy.scope():
        model = keras.Sequential(
            [
                keras.Input((4,)),
                keras.layers.Dense(8, activation="relu"),
                keras.layers.Dense(1),
            ]
        )
        optimizer = keras.optimizers.Adam(0.01)
    return model, optimizer


def _train(strategy, model, optimizer, batches):
    """A tf.distribute custom loop: one ``strategy.run`` per global batch."""

    def replica_step(x, y):
        def loss_fn():
            per_example = keras.losses.mean_squared_error(y, model(x, training=True))
            return kd.nn.compute_average_loss(per_example, global_batch_size=GLOBAL_BATCH)

        loss, grads = kd.value_and_grad(loss_fn, model.trainable_variables)()
        optimizer.apply_gradients(zip(grads, model.trainable_variables))
        return loss

    for x, y in strategy.experimental_distribute_dataset(batches):
        strategy.run(replica_step, args=(x, y))


def _values(variables):
    return [np.asarray(v.value) for v in variables]


def _assert_equal(got, want):
    assert len(got) == len(want)
    for g, w in zip(got, want):
        np.testing.assert_array_equal(g, w)


def _ckpt_files(directory):
    return sorted(os.path.basename(p) for p in glob.glob(os.path.join(directory, "ckpt-*.npz")))


def test_manager_keeps_max_to_keep_and_restores_weights_and_adam_state_exactly(tmp_path):
    strategy = kd.MirroredStrategy(cpus(2))
    model, optimizer = _model_and_optimizer(strategy)
    batches = _batches(8)
    checkpoint = kd.train.Checkpoint(model=model, optimizer=optimizer)
    manager = kd.train.CheckpointManager(checkpoint, str(tmp_path), max_to_keep=2)
    for step in range(4):
        _train(strategy, model, optimizer, batches[step : step + 1])
        manager.save()
    assert _ckpt_files(tmp_path) == ["ckpt-3.npz", "ckpt-4.npz"]
    assert manager.checkpoints == [str(tmp_path / "ckpt-3"), str(tmp_path / "ckpt-4")]
    assert manager.latest_checkpoint == str(tmp_path / "ckpt-4")
    assert int(optimizer.iterations.numpy()) == 4
    saved_model, saved_optimizer = _values(model.variables), _values(optimizer.variables)

    # Keep training, then go back and train the same steps again: an exact
    # restore of weights, Adam's slots and iterations gives the same weights.
    _train(strategy, model, optimizer, batches[4:6])
    after_two_more = _values(model.variables)
    assert not np.array_equal(after_two_more[0], saved_model[0])
    assert manager.restore_or_initialize() == str(tmp_path / "ckpt-4")
    _assert_equal(_values(model.variables), saved_model)
    _assert_equal(_values(optimizer.variables), saved_optimizer)
    assert int(optimizer.iterations.numpy()) == 4
    assert int(checkpoint.save_counter.numpy()) == 4
    assert all(type(v).__name__ == "MirroredVariable" for v in model.variables)
    _train(strategy, model, optimizer, batches[4:6])
    _assert_equal(_values(model.variables), after_two_more)

    # A new program: new objects and an optimizer whose slots do not exist yet.
    model2, optimizer2 = _model_and_optimizer(strategy, seed=11)
    assert not optimizer2.built
    checkpoint2 = kd.train.Checkpoint(model=model2, optimizer=optimizer2)
    status = checkpoint2.restore(kd.train.latest_checkpoint(str(tmp_path)))
    status.assert_consumed()
    _assert_equal(_values(model2.variables), saved_model)
    _assert_equal(_values(optimizer2.variables), saved_optimizer)
    assert all(type(v).__name__ == "MirroredVariable" for v in optimizer2.variables)
    _train(strategy, model2, optimizer2, batches[4:6])
    _assert_equal(_values(model2.variables), after_two_more)


def test_save_counter_numbers_saves_and_is_restored(tmp_path):
    v = keras.Variable(1.0)
    checkpoint = kd.train.Checkpoint(v=v)
    assert int(checkpoint.save_counter.numpy()) == 0
    prefix = str(tmp_path / "run" / "ckpt")
    paths = [checkpoint.save(prefix) for _ in range(3)]
    assert paths == [f"{prefix}-1", f"{prefix}-2", f"{prefix}-3"]
    assert int(checkpoint.save_counter.numpy()) == 3
    # Checkpoint.save records the latest (TF: the `checkpoint` file).
    assert kd.train.latest_checkpoint(str(tmp_path / "run")) == paths[-1]

    other = kd.train.Checkpoint(v=keras.Variable(0.0))
    other.restore(paths[1]).assert_consumed()
    assert int(other.save_counter.numpy()) == 2
    assert other.save(prefix) == f"{prefix}-3"
    # write() neither numbers nor records.
    assert checkpoint.write(str(tmp_path / "plain")) == str(tmp_path / "plain")
    assert kd.train.latest_checkpoint(str(tmp_path)) is None
    assert int(checkpoint.save_counter.numpy()) == 3
    # read() leaves save_counter alone: a fresh checkpoint's is not created.
    fresh = kd.train.Checkpoint(v=keras.Variable(0.0))
    status = fresh.read(paths[0])
    assert status.unused_keys == ["save_counter"]
    status.assert_existing_objects_matched()
    with pytest.raises(AssertionError, match="save_counter"):
        status.assert_consumed()


def test_nested_checkpoints_lists_and_dicts(tmp_path):
    step = keras.Variable(7)
    layer = keras.layers.Dense(2)
    layer.build((None, 3))
    metric = keras.metrics.Mean()
    metric.update_state([2.0, 4.0])
    inner = kd.train.Checkpoint(layer=layer, extras={"metric": metric, "list": [step]})
    outer = kd.train.Checkpoint(inner=inner, scale=keras.Variable(0.5))
    outer.later = keras.Variable([1.0, 2.0])  # attributes added later are saved too
    path = outer.write(str(tmp_path / "nested"))
    with np.load(path + ".npz") as saved:
        assert sorted(k for k in saved.files if not k.endswith(".json")) == [
            "inner/extras/list/0",
            "inner/extras/metric/0",
            "inner/extras/metric/1",
            "inner/layer/0",
            "inner/layer/1",
            "later",
            "scale",
        ]
    want = [np.asarray(w) for w in layer.weights]

    step2, layer2, metric2 = keras.Variable(0), keras.layers.Dense(2), keras.metrics.Mean()
    layer2.build((None, 3))
    inner2 = kd.train.Checkpoint(layer=layer2, extras={"metric": metric2, "list": [step2]})
    outer2 = kd.train.Checkpoint(inner=inner2, scale=keras.Variable(0.0))
    outer2.later = keras.Variable([0.0, 0.0])
    outer2.read(path).assert_consumed()
    assert int(step2.numpy()) == 7
    assert float(metric2.result()) == 3.0
    _assert_equal([np.asarray(w) for w in layer2.weights], want)
    assert outer2.inner.layer is layer2
    np.testing.assert_array_equal(np.asarray(outer2.later.value), [1.0, 2.0])


def test_latest_checkpoint_and_restore_or_initialize(tmp_path):
    directory = str(tmp_path / "ckpts")
    assert kd.train.latest_checkpoint(directory) is None
    v = keras.Variable(0.0)
    calls = []
    manager = kd.train.CheckpointManager(
        kd.train.Checkpoint(v=v), directory, max_to_keep=3, init_fn=lambda: calls.append(1)
    )
    assert manager.directory == directory
    assert manager.restore_or_initialize() is None and calls == [1]
    for value in (1.0, 2.0):
        v.assign(value)
        manager.save()
    assert kd.train.latest_checkpoint(directory) == os.path.join(directory, "ckpt-2")

    # A restarted program: a new manager finds the list and the latest.
    v2 = keras.Variable(0.0)
    manager2 = kd.train.CheckpointManager(
        kd.train.Checkpoint(v=v2), directory, max_to_keep=3, init_fn=lambda: calls.append(2)
    )
    assert manager2.checkpoints == manager.checkpoints
    assert manager2.restore_or_initialize() == os.path.join(directory, "ckpt-2")
    assert calls == [1] and float(v2.numpy()) == 2.0
    # Numbering continues from the restored save_counter; the oldest goes at max_to_keep.
    assert [os.path.basename(manager2.save()) for _ in range(2)] == ["ckpt-3", "ckpt-4"]
    assert _ckpt_files(directory) == ["ckpt-2.npz", "ckpt-3.npz", "ckpt-4.npz"]
    assert os.path.basename(manager2.save(checkpoint_number=100)) == "ckpt-100"
    assert kd.train.latest_checkpoint(directory).endswith("ckpt-100")
    # restore() of the directory restores its latest checkpoint.
    kd.train.Checkpoint(v=v2).restore(directory).assert_consumed()


def test_max_to_keep_none_and_checkpoint_interval(tmp_path):
    step = keras.Variable(0)
    checkpoint = kd.train.Checkpoint(step=step)
    keep_all = kd.train.CheckpointManager(checkpoint, str(tmp_path / "all"), max_to_keep=None)
    for _ in range(4):
        keep_all.save()
    assert len(_ckpt_files(tmp_path / "all")) == 4
    with pytest.raises(ValueError, match="step_counter"):
        kd.train.CheckpointManager(checkpoint, str(tmp_path), 1, checkpoint_interval=2)
    spaced = kd.train.CheckpointManager(
        checkpoint, str(tmp_path / "spaced"), None, step_counter=step, checkpoint_interval=3
    )
    saved = []
    for value in range(8):
        step.assign(value)
        saved.append(spaced.save(checkpoint_number=step) is not None)
    assert saved == [True, False, False, True, False, False, True, False]
    assert spaced.save(checkpoint_number=step, check_interval=False).endswith("ckpt-7")
    assert spaced.save(checkpoint_number=step, check_interval=False) is None  # same step


def test_sync_on_read_saves_the_aggregate_and_restores_by_tf_rules(tmp_path):
    # Spec F.40: SUM [3, 4] saves 7 and restores as [3.5, 3.5]; MEAN saves 3.5;
    # a SUM checkpoint restores whole into a plain variable; Mirrored saves its value.
    strategy = kd.MirroredStrategy(cpus(2))
    with strategy.scope():
        total = keras.Variable(0.0, synchronization="on_read", aggregation="sum")
        mean = keras.Variable(0.0, synchronization="on_read", aggregation="mean")
        mirrored = keras.Variable(3.0, aggregation="mean")

    def per_replica():
        replica = jnp.asarray(kd.get_replica_context().replica_id_in_sync_group, jnp.float32)
        total.assign(replica + 3.0)
        mean.assign(replica + 3.0)

    strategy.run(per_replica)
    assert numpy_components(total) == [3.0, 4.0]
    path = kd.train.Checkpoint(total=total, mean=mean, mirrored=mirrored).write(
        str(tmp_path / "sync")
    )
    with np.load(str(tmp_path / "sync.npz")) as saved:
        assert float(saved["total"]) == 7.0
        assert float(saved["mean"]) == 3.5
        assert float(saved["mirrored"]) == 3.0

    with strategy.scope():
        total2 = keras.Variable(0.0, synchronization="on_read", aggregation="sum")
        mean2 = keras.Variable(0.0, synchronization="on_read", aggregation="mean")
        mirrored2 = keras.Variable(0.0, aggregation="mean")
    kd.train.Checkpoint(total=total2, mean=mean2, mirrored=mirrored2).read(path).assert_consumed()
    assert numpy_components(total2) == [3.5, 3.5] and float(total2.value) == 7.0
    assert numpy_components(mean2) == [3.5, 3.5]
    assert numpy_components(mirrored2) == [3.0, 3.0]
    plain = keras.Variable(0.0)
    kd.train.Checkpoint(total=plain).read(path).expect_partial()
    assert float(plain.numpy()) == 7.0


def test_status_asserts(tmp_path, caplog):
    a, b = keras.Variable(1.0), keras.Variable(2.0)
    path = kd.train.Checkpoint(a=a, b=b).write(str(tmp_path / "ab"))
    kd.train.Checkpoint(a=a, b=b).read(path).assert_consumed().assert_nontrivial_match()

    extra = kd.train.Checkpoint(a=a).read(path)  # the checkpoint holds b, which no object takes
    extra.assert_existing_objects_matched()
    assert extra.unused_keys == ["b"]
    with pytest.raises(AssertionError, match=r"no object took b"):
        extra.assert_consumed()

    missing = kd.train.Checkpoint(a=a, b=b, c=keras.Variable(3.0)).read(path)
    assert missing.missing_keys == ["c"]
    with pytest.raises(AssertionError, match="no value for c"):
        missing.assert_existing_objects_matched()
    with pytest.raises(AssertionError, match="no value for c"):
        missing.assert_consumed()

    with pytest.raises(AssertionError, match="Nothing was restored"):
        kd.train.Checkpoint(z=keras.Variable(0.0)).read(path).assert_nontrivial_match()
    nothing = kd.train.Checkpoint(a=a).restore(None)
    assert nothing.expect_partial() is nothing
    with pytest.raises(AssertionError, match="save_path=None"):
        nothing.assert_consumed()

    # Unused values are reported when the status goes, unless expect_partial() was called.
    with caplog.at_level(logging.WARNING, logger="keras_dist.train"):
        kd.train.Checkpoint(a=a).read(path).expect_partial()
        assert not caplog.records
        kd.train.Checkpoint(a=a).read(path)
    assert "no object took b" in caplog.text


def test_restore_checks_shapes_and_what_it_can_hold(tmp_path):
    path = kd.train.Checkpoint(v=keras.Variable([1.0, 2.0])).write(str(tmp_path / "v"))
    w = keras.Variable([0.0, 0.0, 0.0])
    u = keras.Variable(5.0)
    with pytest.raises(ValueError, match=r"nothing was restored.*v \(.*\(2,\).*\(3,\)"):
        kd.train.Checkpoint(v=w, v2=u).read(path)
    np.testing.assert_array_equal(np.asarray(w.value), [0.0, 0.0, 0.0])
    with pytest.raises(ValueError, match="expecting `step` to be a Keras model"):
        kd.train.Checkpoint(step=3)
    with pytest.raises(ValueError, match="`save_counter`"):
        kd.train.Checkpoint(save_counter=keras.Variable(0))
    with pytest.raises(FileNotFoundError, match="no-such"):
        kd.train.Checkpoint(v=w).restore(str(tmp_path / "no-such"))
    # Another dtype is refused, as TF refuses it (a cast would give other values).
    number = kd.train.Checkpoint(v=keras.Variable(2.7)).write(str(tmp_path / "float"))
    count = keras.Variable(0, dtype="int32")
    with pytest.raises(ValueError, match=r"checkpoint dtype float32, variable dtype int32"):
        kd.train.Checkpoint(v=count).read(number)
    assert int(count.numpy()) == 0
    # An optimizer's int64 counter holds int32 values without x64: that restores.
    iterations = keras.Variable(7, dtype="int64")
    saved = kd.train.Checkpoint(i=iterations).write(str(tmp_path / "iterations"))
    iterations.assign(0)
    kd.train.Checkpoint(i=iterations).read(saved).assert_consumed()
    assert int(iterations.numpy()) == 7


class _StandInTFVariable:
    """What a checkpoint reads of a ``tf.Variable``, in a module named as TF's are."""

    __module__ = "tensorflow.python.ops.stand_in"

    def __init__(self, value, dtype):
        self._value = np.asarray(value, dtype)
        self.name = "step:0"
        self.dtype = np.dtype(dtype)  # (TF's DType has a `name` too)

    @property
    def shape(self):
        return self._value.shape

    def numpy(self):
        return self._value.copy()

    def assign(self, value):
        self._value = np.asarray(value, self._value.dtype)


def _round_trip(tmp_path, step, epoch_and_values):
    """Saves ``step`` and ``epoch_and_values`` with a Keras variable, changes them all,
    restores; returns the restore's status."""
    weight = keras.Variable([1.0, 2.0])
    checkpoint = kd.train.Checkpoint(step=step, weight=weight, counters=epoch_and_values)
    path = checkpoint.save(str(tmp_path / "ckpt"))
    step.assign(step.numpy() + 10)
    for counter in epoch_and_values:
        counter.assign(counter.numpy() * 0)
    weight.assign([0.0, 0.0])
    status = kd.train.Checkpoint(step=step, weight=weight, counters=epoch_and_values).restore(path)
    np.testing.assert_array_equal(np.asarray(weight.value), [1.0, 2.0])
    return status


def test_a_tf_variable_is_saved_and_restored_like_a_variable(tmp_path):
    step = _StandInTFVariable(7, "int32")
    scales = _StandInTFVariable([0.5, 1.5], "float32")
    status = _round_trip(tmp_path, step, [scales])
    status.assert_consumed()
    assert step.numpy().dtype == np.int32 and int(step.numpy()) == 7
    np.testing.assert_array_equal(scales.numpy(), [0.5, 1.5])


def test_a_tf_variable_is_saved_and_restored_with_tensorflow(tmp_path):
    tf = pytest.importorskip("tensorflow")
    step, epoch = tf.Variable(0), tf.Variable(3, dtype=tf.int64)
    scales = tf.Variable([0.5, 1.5])
    for _ in range(5):
        step.assign_add(1)  # (a tutorial's counter, advanced by its loop)
    _round_trip(tmp_path, step, [epoch, scales]).assert_consumed()
    assert int(step.numpy()) == 5 and int(epoch.numpy()) == 3
    np.testing.assert_array_equal(scales.numpy(), [0.5, 1.5])
    # TF's rule, as for Keras variables: another dtype is refused, nothing assigned.
    path = kd.train.Checkpoint(step=tf.Variable(2.5)).write(str(tmp_path / "float"))
    with pytest.raises(ValueError, match=r"checkpoint dtype float32, variable dtype int32"):
        kd.train.Checkpoint(step=step).read(path)
    assert int(step.numpy()) == 5
    # A manager's step counter and checkpoint number may be one too.
    manager = kd.train.CheckpointManager(
        kd.train.Checkpoint(step=step), str(tmp_path / "managed"), 3, step_counter=step
    )
    assert manager.save(checkpoint_number=step).endswith("-5")


@pytest.mark.parametrize("method", ["save", "write", "restore", "read"])
def test_checkpoint_calls_inside_a_replica_say_where_to_call_them(tmp_path, method):
    strategy = kd.MirroredStrategy(cpus(2))
    with strategy.scope():
        v = keras.Variable(1.0)
    checkpoint = kd.train.Checkpoint(v=v)
    path = kd.train.Checkpoint(v=v).write(str(tmp_path / "first"))
    argument = path if method in ("restore", "read") else str(tmp_path / "ckpt")
    with pytest.raises(RuntimeError, match=f"`Checkpoint.{method}` must be called in the cross"):
        strategy.run(lambda: getattr(checkpoint, method)(argument))
    assert int(checkpoint.save_counter.numpy()) == 0  # nothing counted


def test_max_to_keep_must_be_positive_or_none(tmp_path):
    checkpoint = kd.train.Checkpoint(v=keras.Variable(1.0))
    for bad in (0, -1):
        with pytest.raises(ValueError, match=f"positive.*Received: max_to_keep={bad}"):
            kd.train.CheckpointManager(checkpoint, str(tmp_path), max_to_keep=bad)


def test_unbuilt_optimizer_needs_one_model_to_build_for(tmp_path):
    model, optimizer = _model_and_optimizer(kd.get_strategy())
    optimizer.build(model.trainable_variables)
    path = kd.train.Checkpoint(optimizer=optimizer).write(str(tmp_path / "opt"))
    alone = keras.optimizers.Adam(0.01)
    with pytest.raises(ValueError, match="optimizer.build"):
        kd.train.Checkpoint(optimizer=alone).read(path)
    unbuilt_model = keras.Sequential([keras.layers.Dense(1)])
    model_path = kd.train.Checkpoint(model=model).write(str(tmp_path / "model"))
    with pytest.raises(ValueError, match="has no variables yet"):
        kd.train.Checkpoint(model=unbuilt_model).read(model_path)


def _damage(path, how):
    data = bytearray(open(path, "rb").read())
    if how == "truncate":
        data = data[: len(data) // 2]
    else:
        data[len(data) // 3] ^= 0xFF  # inside an array member: its CRC-32 no longer matches
    with open(path, "wb") as file:
        file.write(bytes(data))


@pytest.mark.parametrize("how", ["truncate", "flip"])
def test_damaged_checkpoint_raises_naming_it_and_the_manager_falls_back(tmp_path, how, caplog):
    v = keras.Variable(np.zeros(64, "float32"))
    manager = kd.train.CheckpointManager(kd.train.Checkpoint(v=v), str(tmp_path), max_to_keep=3)
    for value in (1.0, 2.0):
        v.assign(np.full(64, value, "float32"))
        manager.save()
    latest = manager.latest_checkpoint
    _damage(latest + ".npz", how)
    v.assign(np.zeros(64, "float32"))
    with pytest.raises(kd.train.CheckpointUnreadableError, match="ckpt-2.npz"):
        kd.train.Checkpoint(v=v).restore(latest)
    np.testing.assert_array_equal(np.asarray(v.value), np.zeros(64))  # nothing assigned
    with caplog.at_level(logging.WARNING, logger="keras_dist.train"):
        assert manager.restore_or_initialize() == str(tmp_path / "ckpt-1")
    assert "ckpt-2" in caplog.text
    np.testing.assert_array_equal(np.asarray(v.value), np.ones(64))
    _damage(str(tmp_path / "ckpt-1.npz"), how)
    with pytest.raises(kd.train.CheckpointUnreadableError, match="ckpt-2.npz"):
        manager.restore_or_initialize()
    with open(tmp_path / "checkpoint", "w") as file:
        file.write("{not json")
    with pytest.raises(kd.train.CheckpointUnreadableError, match="checkpoint"):
        kd.train.latest_checkpoint(str(tmp_path))


def _header_offsets(path) -> list:
    """The bytes of every ZIP header in ``path``: local headers, central directory, end record."""
    import zipfile

    with zipfile.ZipFile(path) as archive:
        infos = archive.infolist()
    size = os.path.getsize(path)
    offsets = []
    for info in infos:
        start = info.header_offset
        offsets += range(start, start + 30 + len(info.filename.encode()))
    directory = min(size, size - 22 - sum(46 + len(i.filename.encode()) for i in infos))
    offsets += range(directory, size)
    return sorted(set(offsets))


def test_every_flipped_bit_in_the_zip_headers_is_a_named_error_or_harmless(tmp_path):
    # A flipped bit in a header can name an unknown compression method
    # (zipfile: NotImplementedError) or set the "encrypted" flag (RuntimeError):
    # both must read as a damaged checkpoint, so the manager falls back past it.
    v = keras.Variable(np.arange(8, dtype="float32"))
    path = kd.train.Checkpoint(v=v).write(str(tmp_path / "ckpt"))
    original = open(path + ".npz", "rb").read()
    outcomes = {"restored": 0, "unreadable": 0}
    for offset in _header_offsets(path + ".npz"):
        for bit in range(8):
            damaged = bytearray(original)
            damaged[offset] ^= 1 << bit
            with open(path + ".npz", "wb") as file:
                file.write(bytes(damaged))
            v.assign(np.zeros(8, "float32"))
            try:
                kd.train.Checkpoint(v=v).read(path)
            except kd.train.CheckpointUnreadableError:
                outcomes["unreadable"] += 1
                np.testing.assert_array_equal(np.asarray(v.value), np.zeros(8))
            else:
                outcomes["restored"] += 1
                np.testing.assert_array_equal(np.asarray(v.value), np.arange(8))
    assert outcomes["unreadable"] > 0 and outcomes["restored"] > 0, outcomes


@pytest.mark.parametrize("field", ["compression method", "encrypted flag"])
def test_a_damaged_header_makes_the_manager_fall_back(tmp_path, field):
    import zipfile

    v = keras.Variable(np.zeros(4, "float32"))
    manager = kd.train.CheckpointManager(kd.train.Checkpoint(v=v), str(tmp_path), max_to_keep=3)
    for value in (1.0, 2.0):
        v.assign(np.full(4, value, "float32"))
        manager.save()
    latest = manager.latest_checkpoint + ".npz"
    with zipfile.ZipFile(latest) as archive:
        entry = archive.start_dir  # the first member's central-directory record
    data = bytearray(open(latest, "rb").read())
    if field == "compression method":
        data[entry + 10] = 99  # no such method: zipfile raises NotImplementedError
    else:
        data[entry + 8] |= 1  # "encrypted": zipfile raises RuntimeError
    with open(latest, "wb") as file:
        file.write(bytes(data))
    assert manager.restore_or_initialize() == str(tmp_path / "ckpt-1")
    np.testing.assert_array_equal(np.asarray(v.value), np.ones(4))


def _play(monkeypatch, role):
    monkeypatch.setattr(_objects, "process_role", lambda variables: role)


def test_only_the_chief_writes_at_the_users_path(tmp_path, monkeypatch):
    cluster = ClusterSpec({"chief": ["c:1"], "worker": ["w0:1"]})
    v = keras.Variable(1.0)
    checkpoint = kd.train.Checkpoint(v=v)
    _play(monkeypatch, ProcessRole("worker", 0, cluster))
    directory = tmp_path / "ckpts"
    manager = kd.train.CheckpointManager(checkpoint, str(directory), max_to_keep=1)
    assert manager.save() == str(directory / "ckpt-1")
    assert checkpoint.write(str(directory / "w")) == str(directory / "w")
    assert manager.save() == str(directory / "ckpt-2")
    assert manager.checkpoints == [str(directory / "ckpt-2")]
    # The worker wrote into workertemp_0 and removed it: nothing at the user's path.
    assert not directory.exists() or os.listdir(directory) == []

    _play(monkeypatch, ProcessRole("chief", 0, cluster))
    chief = kd.train.CheckpointManager(checkpoint, str(directory), max_to_keep=1)
    chief.save()
    assert sorted(os.listdir(directory)) == ["checkpoint", "ckpt-3.npz"]
    # A worker restores from the chief's checkpoint.
    _play(monkeypatch, ProcessRole("worker", 0, cluster))
    v.assign(0.0)
    assert kd.train.CheckpointManager(checkpoint, str(directory), 1).restore_or_initialize()
    assert float(v.numpy()) == 1.0


KILLED_WRITER = r"""
import sys, time
import numpy as np
import keras, keras_dist as kd

directory, size = sys.argv[1], int(sys.argv[2])
a = keras.Variable(np.zeros(size, "float32"))
b = keras.Variable(np.zeros(size, "float32"))
checkpoint = kd.train.Checkpoint(a=a, b=b)
manager = kd.train.CheckpointManager(checkpoint, directory, max_to_keep=2)
manager.restore_or_initialize()
deadline = time.monotonic() + 120  # the test kills us long before
while time.monotonic() < deadline:
    n = int(np.asarray(checkpoint.save_counter.value)) + 1
    a.assign(np.full(size, n, "float32"))
    b.assign(np.full(size, -n, "float32"))
    manager.save()
    print("saved", n, flush=True)
"""


def _lines(stream, into: queue.Queue):
    for line in stream:
        into.put(line)
    into.put(None)


def test_sigkill_during_saves_never_leaves_an_unreadable_latest_checkpoint(tmp_path):
    rng = random.Random(20240611)
    directory = str(tmp_path / "ckpts")
    size = 1 << 20  # 4 MB a variable: a save takes long enough to be killed inside it
    env = dict(os.environ, KERAS_BACKEND="jax", JAX_PLATFORMS="cpu")
    env.pop("XLA_FLAGS", None)
    last_seen = 0
    for _ in range(6):
        process = subprocess.Popen(
            [sys.executable, "-c", KILLED_WRITER, directory, str(size)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        lines: queue.Queue = queue.Queue()
        threading.Thread(target=_lines, args=(process.stdout, lines), daemon=True).start()
        try:
            wanted, saved = rng.randint(1, 4), []
            deadline = time.monotonic() + 120
            while len(saved) < wanted:
                line = lines.get(timeout=max(0.0, deadline - time.monotonic()))
                assert line is not None, process.stderr.read()[-3000:]
                saved.append(int(line.split()[1]))
            # The moment to kill at, somewhere inside the next save.
            time.sleep(rng.uniform(0.0, 0.05))
            process.kill()
            process.wait(timeout=60)
            # Every line it printed before it died: the saves it finished (a line
            # cut off by the kill has no newline yet, and its save may not be done).
            while (line := lines.get(timeout=60)) is not None:
                if re.fullmatch(r"saved \d+\n", line):
                    saved.append(int(line.split()[1]))
        finally:
            if process.poll() is None:
                process.kill()
                process.wait(timeout=60)
            process.stdout.close()
            process.stderr.close()
        assert saved[0] == last_seen + 1 or last_seen == 0  # the restart resumed
        last_seen = saved[-1]

        latest = kd.train.latest_checkpoint(directory)
        assert latest is not None
        a, b = keras.Variable(np.zeros(size, "float32")), keras.Variable(np.zeros(size, "float32"))
        checkpoint = kd.train.Checkpoint(a=a, b=b)
        checkpoint.restore(latest).assert_consumed()
        n = int(np.asarray(checkpoint.save_counter.value))
        assert n in (last_seen, last_seen + 1)  # the kill may land after a save's last write
        np.testing.assert_array_equal(np.asarray(a.value), np.full(size, n, "float32"))
        np.testing.assert_array_equal(np.asarray(b.value), np.full(size, -n, "float32"))
        assert len(_ckpt_files(directory)) <= 3
        last_seen = n
    # Temporary files of killed saves are cleaned by the next save.
    assert len(glob.glob(os.path.join(directory, ".keras_dist-tmp-*"))) <= 1


def test_a_checkpoint_file_is_a_plain_zip_of_npy_arrays(tmp_path):
    path = kd.train.Checkpoint(v=keras.Variable([1.0, 2.0])).write(str(tmp_path / "z"))
    with zipfile.ZipFile(path + ".npz") as archive:
        assert sorted(archive.namelist()) == ["keras_dist_checkpoint.json", "v.npy"]
    with np.load(path + ".npz") as saved:
        np.testing.assert_array_equal(saved["v"], [1.0, 2.0])


def _two_worker_checkpoint(directory):
    strategy = kd.MultiWorkerMirroredStrategy()
    model, optimizer = _model_and_optimizer(strategy)
    with strategy.scope():
        total = keras.Variable(0.0, synchronization="on_read", aggregation="sum")

    def count(x, y):
        total.assign_add(1.0)

    batches = _batches(3)
    _train(strategy, model, optimizer, batches)
    for x, y in strategy.experimental_distribute_dataset(batches):
        strategy.run(count, args=(x, y))
    checkpoint = kd.train.Checkpoint(model=model, optimizer=optimizer, total=total)
    manager = kd.train.CheckpointManager(checkpoint, directory, max_to_keep=1)
    manager.save()
    manager.save()
    listing = sorted(os.listdir(directory))  # every process sees the chief's files

    def host(variables):
        return [np.asarray(v.value.addressable_data(0)) for v in variables]

    want = host(model.variables + optimizer.variables)
    for variable in model.variables:
        variable.assign(np.zeros(variable.shape, "float32"))
    restored = manager.restore_or_initialize()
    got = host(model.variables + optimizer.variables)
    same = all(np.array_equal(a, b) for a, b in zip(want, got))
    return {"listing": listing, "restored": restored, "same": same, "total": host([total])[0]}


@pytest.mark.multiprocess
def test_two_workers_save_once_at_the_chiefs_path_and_both_restore(tmp_path):
    directory = str(tmp_path / "ckpts")
    results = kd.launch(
        _two_worker_checkpoint,
        num_workers=2,
        devices_per_worker=2,
        args=(directory,),
        timeout=180,
        stream_output=False,
    )
    for result in results:
        assert result["listing"] == ["checkpoint", "ckpt-2.npz"]
        assert result["restored"] == os.path.join(directory, "ckpt-2") and result["same"]
        assert float(result["total"]) == 12.0  # 3 steps on 4 replicas, saved and restored
    # Only the chief wrote there; the worker's temporary directory is gone.
    assert sorted(os.listdir(directory)) == ["checkpoint", "ckpt-2.npz"]


def test_an_unbuilt_model_is_refused_before_its_optimizer_is_built(tmp_path):
    # TF's custom-training tutorial restores an optimizer and a model made afresh, before
    # the model is built. The refusal must leave the optimizer unbuilt: building it for
    # the model's (empty) variables first made the restore after `model.build` go wrong.
    model, optimizer = _model_and_optimizer(kd.get_strategy())
    optimizer.build(model.trainable_variables)
    path = kd.train.Checkpoint(optimizer=optimizer, model=model).write(str(tmp_path / "both"))
    new_model = keras.Sequential(
        [keras.layers.Dense(8, activation="relu"), keras.layers.Dense(1)]
    )  # no Input: unbuilt, as the tutorial's create_model()
    new_optimizer = keras.optimizers.Adam(0.01)
    checkpoint = kd.train.Checkpoint(optimizer=new_optimizer, model=new_model)
    with pytest.raises(ValueError, match="`model` \\(Sequential\\) has no variables yet"):
        checkpoint.read(path)
    assert not new_optimizer.built
    new_model.build((None, 4))
    checkpoint.read(path).assert_consumed()
    for restored, saved in zip(new_model.get_weights(), model.get_weights()):
        np.testing.assert_array_equal(restored, saved)
    for restored, saved in zip(new_optimizer.variables, optimizer.variables):
        np.testing.assert_array_equal(np.asarray(restored), np.asarray(saved))
