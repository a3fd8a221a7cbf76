"""kd.experimental.PreemptionCheckpointHandler: save at a step boundary on notice, exit, resume."""

import os
import queue
import signal
import subprocess
import sys
import threading
import time

import keras
import numpy as np
import pytest

import keras_dist as kd
from keras_dist.train import _termination

TRAINER = r"""
import sys
import numpy as np
import keras, keras_dist as kd

directory, out, steps, pause_after = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
strategy = kd.MirroredStrategy(["/cpu:0", "/cpu:1"])
keras.utils.set_random_seed(1)
with strategy.scope():
    model = keras.Sequential(
        [keras.Input((4,)), keras.layers.Dense(8, activation="relu"), keras.layers.Dense(1)]
    )
    optimizer = keras.optimizers.Adam(0.01)
checkpoint = kd.train.Checkpoint(model=model, optimizer=optimizer)
handler = kd.experimental.PreemptionCheckpointHandler(
    strategy.cluster_resolver, checkpoint, directory
)
print("resumed at", handler.total_run_calls, flush=True)

rng = np.random.default_rng(0)
xs = rng.normal(size=(steps, 8, 4)).astype("float32")
ys = xs @ np.array([[1.0], [-2.0], [0.5], [3.0]], "float32")


def replica_step(x, y):
    def loss_fn():
        per_example = keras.losses.mean_squared_error(y, model(x, training=True))
        return kd.nn.compute_average_loss(per_example, global_batch_size=8)

    loss, grads = kd.value_and_grad(loss_fn, model.trainable_variables)()
    optimizer.apply_gradients(zip(grads, model.trainable_variables))
    return loss


def train_step(i):
    x, y = next(iter(strategy.experimental_distribute_dataset([(xs[i], ys[i])])))
    return strategy.reduce("SUM", strategy.run(replica_step, args=(x, y)), axis=None)


while handler.total_run_calls < steps:
    handler.run(train_step, handler.total_run_calls)
    if handler.total_run_calls == pause_after:
        # Wait here for the test: it sends SIGTERM, then a line.
        print("paused after", pause_after, flush=True)
        sys.stdin.readline()
np.savez(out, *[np.asarray(v.value) for v in model.variables + optimizer.variables])
print("finished", flush=True)
"""

STEPS = 10
PAUSE_AFTER = 4


def _env():
    env = dict(os.environ, KERAS_BACKEND="jax", JAX_PLATFORMS="cpu")
    env["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2"
    return env


def _run_to_end(directory, out):
    result = subprocess.run(
        [sys.executable, "-c", TRAINER, directory, out, str(STEPS), "-1"],
        capture_output=True,
        text=True,
        timeout=300,
        env=_env(),
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout


def _reader(stream, into: queue.Queue):
    for line in stream:
        into.put(line)
    into.put(None)


def _wait_for(lines: queue.Queue, text: str, deadline: float, process) -> str:
    while True:
        line = lines.get(timeout=max(0.0, deadline - time.monotonic()))
        assert line is not None, f"exited with {process.wait(timeout=60)} before {text!r}"
        if text in line:
            return line


def test_sigterm_saves_exits_42_and_a_rerun_resumes_to_the_uninterrupted_weights(tmp_path):
    reference = str(tmp_path / "reference.npz")
    _run_to_end(str(tmp_path / "uninterrupted"), reference)

    directory = str(tmp_path / "preempted")
    out = str(tmp_path / "resumed.npz")
    process = subprocess.Popen(
        [sys.executable, "-c", TRAINER, directory, out, str(STEPS), str(PAUSE_AFTER)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=_env(),
    )
    lines: queue.Queue = queue.Queue()
    threading.Thread(target=_reader, args=(process.stdout, lines), daemon=True).start()
    try:
        deadline = time.monotonic() + 240
        _wait_for(lines, "paused after", deadline, process)
        process.send_signal(signal.SIGTERM)
        process.stdin.write("go on\n")
        process.stdin.flush()
        code = process.wait(timeout=120)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait(timeout=60)
    stderr = process.stderr.read()
    for stream in (process.stdin, process.stdout, process.stderr):
        stream.close()
    assert code == 42, stderr[-3000:]
    assert not os.path.exists(out)  # it stopped before finishing
    latest = kd.train.latest_checkpoint(directory)
    assert latest is not None
    with np.load(latest + ".npz") as saved:
        assert int(saved["checkpointed_runs"]) == PAUSE_AFTER
        assert int(saved["optimizer/0"]) == PAUSE_AFTER  # Adam's iterations

    stdout = _run_to_end(directory, out)
    assert f"resumed at {PAUSE_AFTER}" in stdout
    with np.load(reference) as want, np.load(out) as got:
        assert want.files == got.files
        for name in want.files:
            np.testing.assert_array_equal(got[name], want[name])


@pytest.fixture
def fast_polling(monkeypatch):
    monkeypatch.setattr(_termination, "POLL_INTERVAL_SECONDS", 0.01)


def _run_until(handler, condition, step=lambda: None, seconds=30):
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, "the handler did not act on the notice in time"
        handler.run(step)


def test_termination_watcher_fn_saves_calls_exit_fn_and_a_new_handler_resumes(
    tmp_path, fast_polling
):
    v = keras.Variable(0.0)
    notice, exits = threading.Event(), []
    config = kd.experimental.TerminationConfig(
        termination_watcher_fn=notice.is_set, exit_fn=lambda: exits.append(v.numpy())
    )
    checkpoint = kd.train.Checkpoint(v=v)
    handler = kd.experimental.PreemptionCheckpointHandler(None, checkpoint, str(tmp_path), config)
    assert handler.total_run_calls == 0
    for _ in range(3):
        handler.run(lambda: v.assign_add(1.0))
    notice.set()
    _run_until(handler, lambda: exits, step=lambda: v.assign_add(1.0))
    saved_runs = int(checkpoint.checkpointed_runs.numpy())
    assert saved_runs >= 3 and float(exits[0]) == saved_runs  # saved before the next step

    # A restarted program: the handler restores where the save was made.
    v2 = keras.Variable(0.0)
    again = kd.experimental.PreemptionCheckpointHandler(
        None,
        kd.train.Checkpoint(v=v2),
        str(tmp_path),
        kd.experimental.TerminationConfig(termination_watcher_fn=lambda: False),
    )
    assert again.total_run_calls == saved_runs
    assert float(v2.numpy()) == saved_runs


def test_grace_period_saves_at_once_then_again_before_exiting(tmp_path, fast_polling):
    saves, exits, notice = [], [], threading.Event()
    manager = kd.train.CheckpointManager(
        kd.train.Checkpoint(v=keras.Variable(0.0)), str(tmp_path), max_to_keep=5
    )
    handler = kd.experimental.PreemptionCheckpointHandler(
        None,
        manager,
        termination_config=kd.experimental.TerminationConfig(
            termination_watcher_fn=notice.is_set,
            exit_fn=lambda: exits.append(handler.total_run_calls),
            grace_period=0.3,
            save_fn=lambda: saves.append(handler.total_run_calls) or manager.save(),
        ),
    )
    notice.set()
    _run_until(handler, lambda: saves)
    assert not exits  # the grace period: training goes on after the first save
    _run_until(handler, lambda: exits)
    assert len(saves) == 2 and saves[1] > saves[0] and exits == [saves[1]]
    assert len(manager.checkpoints) == 2


def test_save_checkpoint_if_preempted_and_watch_preemption_scope(tmp_path, fast_polling):
    notice, exits = threading.Event(), []
    handler = kd.experimental.PreemptionCheckpointHandler(
        None,
        kd.train.Checkpoint(v=keras.Variable(1.0)),
        str(tmp_path),
        kd.experimental.TerminationConfig(
            termination_watcher_fn=notice.is_set, exit_fn=lambda: exits.append(1)
        ),
    )
    notice.set()
    deadline = time.monotonic() + 30
    with handler.watch_preemption_scope():
        while not exits:
            assert time.monotonic() < deadline
            handler.save_checkpoint_if_preempted()
    assert kd.train.latest_checkpoint(str(tmp_path)) is not None


def test_sigterm_is_watched_in_process_and_given_back(tmp_path):
    before = signal.getsignal(signal.SIGTERM)
    exits = []
    checkpoint = kd.train.Checkpoint(v=keras.Variable(1.0))
    handler = kd.experimental.PreemptionCheckpointHandler(
        None,
        checkpoint,
        str(tmp_path),
        kd.experimental.TerminationConfig(exit_fn=lambda: exits.append(1)),
    )
    assert signal.getsignal(signal.SIGTERM) is not before
    handler.run(lambda: None)
    signal.raise_signal(signal.SIGTERM)  # the Python handler runs before the next line
    assert not exits
    handler.run(lambda: None)
    assert exits == [1] and int(checkpoint.checkpointed_runs.numpy()) == 1
    # exit_fn returned (an in-process restart): the step ran, and SIGTERM is given back.
    assert handler.total_run_calls == 2
    assert signal.getsignal(signal.SIGTERM) is before
    del handler
    assert signal.getsignal(signal.SIGTERM) is before  # dropped: SIGTERM given back


def test_bad_arguments(tmp_path):
    checkpoint = kd.train.Checkpoint(v=keras.Variable(1.0))
    with pytest.raises(ValueError, match="checkpoint_dir must be passed"):
        kd.experimental.PreemptionCheckpointHandler(None, checkpoint)
    with pytest.raises(TypeError, match="Checkpoint"):
        kd.experimental.PreemptionCheckpointHandler(None, object(), str(tmp_path))
    errors = []

    def in_a_thread():
        try:
            kd.experimental.PreemptionCheckpointHandler(None, checkpoint, str(tmp_path))
        except RuntimeError as error:
            errors.append(str(error))

    thread = threading.Thread(target=in_a_thread)
    thread.start()
    thread.join(timeout=60)
    assert errors and "main thread" in errors[0]


def _preemptible_worker(directory, marker, steps):
    strategy = kd.MultiWorkerMirroredStrategy(
        communication_options=kd.experimental.CommunicationOptions(timeout_seconds=60)
    )
    keras.utils.set_random_seed(1)
    with strategy.scope():
        model = keras.Sequential(
            [keras.Input((4,)), keras.layers.Dense(8, activation="relu"), keras.layers.Dense(1)]
        )
        optimizer = keras.optimizers.Adam(0.01)
    checkpoint = kd.train.Checkpoint(model=model, optimizer=optimizer)
    handler = kd.experimental.PreemptionCheckpointHandler(
        strategy.cluster_resolver, checkpoint, directory
    )
    rng = np.random.default_rng(0)
    xs = rng.normal(size=(steps, 8, 4)).astype("float32")
    ys = xs @ np.array([[1.0], [-2.0], [0.5], [3.0]], "float32")

    def replica_step(x, y):
        def loss_fn():
            per_example = keras.losses.mean_squared_error(y, model(x, training=True))
            return kd.nn.compute_average_loss(per_example, global_batch_size=8)

        loss, grads = kd.value_and_grad(loss_fn, model.trainable_variables)()
        optimizer.apply_gradients(zip(grads, model.trainable_variables))
        return loss

    def train_step(i):
        x, y = next(iter(strategy.experimental_distribute_dataset([(xs[i], ys[i])])))
        return strategy.run(replica_step, args=(x, y))

    while handler.total_run_calls < steps:
        handler.run(train_step, handler.total_run_calls)
        if marker and handler.total_run_calls >= 3:
            open(marker, "a").close()
            time.sleep(0.2)  # leaves the test time to send SIGTERM mid-training
    return [np.asarray(v.value.addressable_data(0)) for v in model.variables]


@pytest.mark.multiprocess
def test_sigterm_to_one_worker_saves_on_both_at_one_step_and_the_rerun_resumes(tmp_path):
    from keras_dist import testing

    steps, timeout = 30, 180
    reference = kd.launch(
        _preemptible_worker,
        num_workers=2,
        args=(str(tmp_path / "reference"), "", steps),
        timeout=timeout,
        stream_output=False,
    )
    directory, marker = str(tmp_path / "preempted"), tmp_path / "mid_training"
    cluster = testing.create_cluster_spec(num_workers=2)
    args = (directory, str(marker), steps)
    with testing.MultiProcessRunner(
        _preemptible_worker, cluster, args=args, devices_per_worker=1, stream_output=False
    ) as runner:
        runner.start()
        deadline = time.monotonic() + timeout
        while not marker.exists():
            assert time.monotonic() < deadline, runner.logs("worker", 0)
            time.sleep(0.05)
        os.kill(runner.process_status()[("worker", 1)].pid, signal.SIGTERM)
        with pytest.raises(testing.UnexpectedSubprocessExitError):
            runner.join(timeout=timeout)
        codes = [runner.exit_code("worker", i) for i in (0, 1)]
        logs = runner.logs("worker", 0) + runner.logs("worker", 1)
    assert codes == [42, 42], logs
    latest = kd.train.latest_checkpoint(directory)
    with np.load(latest + ".npz") as saved:
        runs = int(saved["checkpointed_runs"])
    assert 3 <= runs < steps
    assert sorted(os.listdir(directory)) == ["checkpoint", os.path.basename(latest) + ".npz"]
    resumed = kd.launch(
        _preemptible_worker,
        num_workers=2,
        args=(directory, "", steps),
        timeout=timeout,
        stream_output=False,
    )
    for weights in resumed:
        for got, want in zip(weights, reference[0]):
            np.testing.assert_array_equal(got, want)
