"""``model.fit`` / ``evaluate`` / ``predict`` of a model created under a strategy.

Keras's own loops run unchanged (callbacks, progress bar, History,
validation, ``steps_per_execution``); only the step functions differ. Each
step runs Keras's own ``train_step`` / ``test_step`` / ``predict_step`` on
every replica through ``strategy.run``:

* The replica's loss is scaled by ``local_rows / global_rows`` (a custom
  ``train_step``'s gradients, as the optimizer gets them): the SUM of gradients
  is the global batch's; each Keras loss reduces as a part of the global batch
  (``_keras/_loss_reductions.py``). Losses and metrics are one device's.
* The optimizer's ``apply`` in a replica is the tf.distribute pattern
  (``merge_call`` -> ``batch_reduce_to(SUM)`` -> apply once), so clipping and
  loss scaling see the summed gradients.
* Metrics are SyncOnRead variables; logs read them aggregated.
* A partial last batch is split between replicas as evenly as possible, each
  replica processing only real rows (the eager engine runs it): losses and
  every metric (AUC, Precision, ...) equal one device's. ``predict`` pads the
  batch and drops the padding: one output row per input row.
* On several CPU devices a compiled step has ended when its step function
  returns (``_engine/_gate.py``), except in a loop whose callbacks run nothing
  between two steps (``steps_run_on``): there Keras's host work until the next
  step overlaps the running one, and reading the metrics waits for it.

Keras's trainer reaches these steps through the hooks in ``_keras._trainer``.
"""

import contextlib
import threading

import jax
import numpy as np

from keras_dist import _context
from keras_dist._capabilities import MeshRuntime
from keras_dist._engine import MISSED
from keras_dist._engine import ReplicatedOutput
from keras_dist._engine._gate import GATE
from keras_dist._input import GlobalBatchSplitter
from keras_dist._input import batch_rows
from keras_dist._input import densify
from keras_dist._keras import compiled_under
from keras_dist._keras import execution_batches
from keras_dist._keras import needs_every_replica
from keras_dist._keras import replica_batch_share
from keras_dist._keras import step_state
from keras_dist._keras import step_variables
from keras_dist._keras_steps._custom_steps import counted_by_share
from keras_dist._keras_steps._custom_steps import custom_logs_averaged
from keras_dist._keras_steps._fused_steps import MultiStep
from keras_dist._keras_steps._fused_steps import fused_steps
from keras_dist._keras_steps._fused_steps import steps_fuse
from keras_dist._keras_steps._per_shape_steps import PerShapeSteps
from keras_dist._keras_steps._predict_outputs import pad_rows
from keras_dist._keras_steps._predict_outputs import predicted_rows
from keras_dist._keras_steps._repeated_steps import RepeatedSteps
from keras_dist._keras_steps._uneven_batches import UnevenBatchWatch
from keras_dist._values import PerReplica
from keras_dist._values._variables import DistributedVariable
from keras_dist._values._variables import MirroredVariable


def model_strategy(model):
    """The strategy a model was created (or compiled) under, or ``None``."""
    recorded = compiled_under(model)
    strategies = {
        id(v.distribute_strategy): v.distribute_strategy
        for v in model.variables
        if isinstance(v, DistributedVariable)
    }
    if recorded is not None:
        strategies.setdefault(id(recorded), recorded)
    if len(strategies) > 1:
        raise ValueError(
            "The model's variables were created under different strategies. Create "
            "the model, its optimizer and metrics in one `strategy.scope()`. "
            f"Received: strategies={list(strategies.values())}"
        )
    strategy = next(iter(strategies.values()), None)
    if strategy is not None:
        plain = [v.path for v in model.variables if not isinstance(v, DistributedVariable)]
        if plain:
            raise ValueError(
                f"Some of the model's variables were created outside `{strategy!r}.scope()` "
                f"and cannot be distributed: {plain[:5]}. Create and build the model "
                "inside `with strategy.scope():`. Received: variables outside the scope="
                f"{len(plain)}"
            )
        _check_optimizer_in_scope(model, strategy)
    return strategy


def _check_optimizer_in_scope(model, strategy) -> None:
    # Keras makes an optimizer's step counter (and learning rate) when it is created:
    # one created outside the scope would count nothing under the strategy (TF refuses it).
    optimizer = getattr(model, "optimizer", None)
    variables = getattr(optimizer, "variables", None) or []
    plain = [v.path for v in variables if not isinstance(v, DistributedVariable)]
    if plain:
        raise ValueError(
            f"The model's optimizer was created outside `{strategy!r}.scope()`: its "
            f"variables {plain[:3]} are not distributed, and its step counter would not "
            "count the steps. Create the optimizer inside `with strategy.scope():`, e.g. "
            "call `model.compile(optimizer=keras.optimizers.Adam(...), ...)` there. "
            f"Received: optimizer={type(optimizer).__name__} with {len(plain)} variables "
            "outside the scope"
        )


def check_fit_context(model):
    """Raises when a model built outside any strategy is trained inside a scope."""
    if _context.strategy_in_effect() is not None:
        current = _context.get_strategy()
        raise ValueError(
            f"This model was created outside any strategy scope, but `fit`, `evaluate` "
            f"or `predict` was called inside `{current!r}.scope()`. Create the model "
            "(and compile it) inside `with strategy.scope():` so that its variables are "
            "distributed. Received: a model with plain Keras variables."
        )


def _replicated_logs(logs):
    """Logs are read from aggregated metrics: the same on every replica, returned once."""
    replica_context = _context.current_frame().replica_context
    if replica_context is None or replica_context.eager_index is not None:
        return logs
    return jax.tree_util.tree_map(ReplicatedOutput, logs)


def uneven_in_one_program(extended) -> bool:
    """Whether ``fit``'s uneven batches run as one program of every replica (``strategy.run``'s
    uneven engine) rather than one program per replica: on one process's CPU devices."""
    return (
        isinstance(extended, MeshRuntime)
        and not extended.spans_processes
        and extended.local_devices[0].platform == "cpu"
    )


def _first_component(value):
    """One replica's log value (eager runs give one per replica)."""
    if isinstance(value, PerReplica):
        return value.values[0]
    return value


def check_same_batches_on_every_worker(extended, layout) -> None:
    """Fails clearly when the workers' data would give them different steps.

    Every worker reads the same global batches and keeps its replicas' pieces;
    a worker with more batches, or another partial last batch, would wait in a
    collective the others never join (gloo then aborts: "Received data size
    doesn't match"). One small collective per epoch compares the layouts.
    """
    if not (isinstance(extended, MeshRuntime) and extended.spans_processes):
        return
    mine = np.asarray([-1 if v is None else int(v) for v in layout], np.int64)
    rows = np.zeros((extended.num_workers, len(mine)), np.int64)
    rows[extended.worker_index] = mine
    everyone = np.asarray(extended.placement.cross_process_sum(rows))
    if (everyone == everyone[0]).all():
        return

    def describe(row):
        steps, batch, last = (None if v < 0 else int(v) for v in row)
        text = f"{steps} batches of {batch} rows"
        return text + (f" (the last of {last})" if last else "")

    raise ValueError(
        "The workers were given different data: every worker must pass the same "
        "inputs to `fit`/`evaluate`/`predict` (each keeps its replicas' pieces of every "
        "global batch), with the same batch size and steps. Give each worker the whole "
        "dataset, or use `distribute_datasets_from_function` for per-worker data. "
        "Received: " + "; ".join(f"worker {i}: {describe(row)}" for i, row in enumerate(everyone))
    )


class _LoopState(threading.local):
    quiet = False  # the loop running on this thread runs nothing between two steps


_LOOP = _LoopState()


@contextlib.contextmanager
def steps_run_on(quiet: bool):
    """One Keras loop; with ``quiet`` its compiled steps may still run when a step
    function returns. Whatever ends the loop, the last step has ended after it."""
    previous, _LOOP.quiet = _LOOP.quiet, quiet
    try:
        yield
    finally:
        _LOOP.quiet = previous
        GATE.wait()


def wait_for_steps() -> None:
    """Waits for a step still running (Keras reads the metrics, a step's results)."""
    GATE.wait()


class DistributedSteps:
    """The train/test/predict functions Keras's loops call, for one model and strategy."""

    def __init__(self, model, strategy):
        self.model = model
        self.strategy = strategy
        self._split = GlobalBatchSplitter(strategy.extended, on_host=True)
        self._predict_rows = None
        self._uneven = PerShapeSteps(model, strategy)
        self._repeated = RepeatedSteps(strategy.extended)
        self._uneven_watch = UnevenBatchWatch(strategy.num_replicas_in_sync)
        # Only where executions are serialized (several CPU devices) is there a wait to defer.
        extended = strategy.extended
        self._serialized = isinstance(extended, MeshRuntime) and extended.placement.serializes
        # One function object each, so that the compiled engine caches their programs.
        self._train_steps = MultiStep(self._replica_train_steps).steps
        self._test_steps = MultiStep(self._replica_test_steps).steps
        self._fuses = None  # (asked on the first execution of several batches)

    # Keras's loops call ``fn(state, iterator)`` and unpack ``(logs, state)``;
    # our state lives in the variables, so ``state`` passes through untouched.
    def train_function(self, state, iterator):
        return self._loop(self._train_batch, self._train_steps, iterator), state

    def test_function(self, state, iterator):
        return self._loop(self._test_batch, self._test_steps, iterator), state

    def predict_function(self, state, iterator):
        outputs = [self._predict_batch(data) for data in self._batches(iterator)]
        if len(outputs) == 1:
            return outputs[0], state
        return jax.tree_util.tree_map(lambda *xs: np.concatenate(xs), *outputs), state

    def _batches(self, iterator) -> list:
        return [densify(batch) for batch in execution_batches(self.model, iterator)]

    def _run(self, fn, *args):
        """``strategy.run``; eagerly when the model was compiled with ``run_eagerly=True``."""
        if self._runs_eagerly():
            GATE.wait()
            return self.strategy.extended.call_for_each_replica(fn, args, {}, eagerly=True)
        with self._may_run_on():
            return self.strategy.run(fn, args=args)

    def _steps_fuse(self, data) -> bool:
        if self._fuses is None:
            self._fuses = steps_fuse(self.strategy.extended.local_devices, self.model, data)
        return self._fuses

    def _runs_eagerly(self) -> bool:
        return self.model.run_eagerly or not self.model.jit_compile

    def _may_run_on(self):
        """Within, a step's program may still run when the step returns (``steps_run_on``)."""
        if self._serialized and _LOOP.quiet:
            return GATE.deferring()
        return contextlib.nullcontext()

    def _loop(self, step, multi_step, iterator):
        batches = self._batches(iterator)
        splits = [None] * len(batches)  # each step splits its own batch
        if len(batches) > 1 and not self._runs_eagerly() and self._steps_fuse(batches[0]):
            # ``steps_per_execution``: the steps of equal, even batches run as one
            # compiled loop, as TF's do (``_fused_steps``).
            splits = [self._split(data) for data in batches]
            if _same_even_layout(splits):
                self._uneven_watch.saw_even()
                rows = tuple(_nonempty_rows(data, "`model.fit`") for data in batches)
                return self._logs(self._run(multi_step, splits, rows), uneven=False)
        logs = None
        for data, split in zip(batches, splits):
            logs = step(data, split)
        return logs

    # ------------------------------------------------------------------ train
    def _train_batch(self, data, split=None):
        logs = self._run_repeated("train", data, split)
        if logs is not MISSED:
            self._uneven_watch.saw_even()
            return logs
        rows = _nonempty_rows(data, "`model.fit`")
        split = self._split(data) if split is None else split
        uneven = _had_uneven(split)
        self._uneven_watch.saw(rows, uneven)
        if uneven and self._runs_uneven_steps():
            GATE.wait()
            return self._uneven.train(split, rows)
        logs = self._run(self._replica_train_step, split, rows)
        self._learn_repeated("train", data, uneven, self._replica_train_step, split, rows)
        return self._logs(logs, uneven)

    def _run_repeated(self, name, data, split):
        """A step's results from its program kept for ``data``'s layout, or ``MISSED``."""
        if split is not None or self._runs_eagerly():
            return MISSED  # (a split batch is one of ``steps_per_execution``'s)
        return self._repeated.run(name, data, within=self._may_run_on)

    def _learn_repeated(self, name, data, uneven, fn, *args):
        """Keeps the program ``strategy.run(fn, args)`` just ran for ``data``'s layout."""
        if not (uneven or self._runs_eagerly()):
            self._repeated.learn(name, data, fn, args)

    def _runs_uneven_steps(self) -> bool:
        """Whether an uneven batch runs as per-shape programs (not while debugging). Not on
        one process's CPU devices, where ``strategy.run``'s uneven engine (one program of
        every replica) is 3x faster, unless a global weighted-mean loss needs them (that
        program cannot all-reduce inside its gradient). On accelerators, always."""
        if self._runs_eagerly() or not self._uneven.supports(self.model):
            return False
        one = uneven_in_one_program(self.strategy.extended)
        return not one or needs_every_replica(self.model)

    def _replica_train_step(self, data, global_rows):
        return self._replica_train_steps([data], [global_rows])

    def _replica_train_steps(self, datas, rows):
        """Keras's ``train_step`` on each batch in turn (``_fused_steps``)."""
        model = self.model
        global_rows = rows[0]  # (fused batches have one layout: one row count)

        def step(state, data):
            with counted_by_share(model, batch_rows(data) / global_rows):
                logs, state = model.train_step(state, data)
            return state, logs

        logs, new_state = fused_steps(step, step_state(model, "train"), datas)
        _write_back(model, "train", new_state)
        return _replicated_logs(custom_logs_averaged(model, "train", logs))

    # ------------------------------------------------------------------- test
    def _test_batch(self, data, split=None):
        logs = self._run_repeated("test", data, split)
        if logs is not MISSED:
            return logs
        rows = _nonempty_rows(data, "`model.evaluate` (or `fit`'s validation)")
        split = self._split(data) if split is None else split
        uneven = _had_uneven(split)
        if uneven and self._runs_uneven_steps():
            GATE.wait()
            return self._uneven.test(split, rows)
        logs = self._run(self._replica_test_step, split, rows)
        self._learn_repeated("test", data, uneven, self._replica_test_step, split, rows)
        return self._logs(logs, uneven)

    def _replica_test_step(self, data, global_rows):
        return self._replica_test_steps([data], [global_rows])

    def _replica_test_steps(self, datas, rows):
        """Keras's ``test_step`` on each batch in turn (``_fused_steps``)."""
        model = self.model
        global_rows = rows[0]  # (fused batches have one layout: one row count)

        def step(state, data):
            with replica_batch_share(batch_rows(data) / global_rows):
                logs, state = model.test_step(state, data)
            return state, logs

        logs, new_state = fused_steps(step, step_state(model, "test"), datas)
        _write_back(model, "test", new_state)
        return _replicated_logs(custom_logs_averaged(model, "test", logs))

    def _logs(self, per_replica_logs, uneven: bool):
        """Logs of a compiled step are aggregated in it; eager ones (also those of an
        ``uneven`` batch, which runs eagerly here) are read after."""
        if uneven or self._runs_eagerly():
            return self.model.get_metrics_result()
        return jax.tree_util.tree_map(
            _first_component, per_replica_logs, is_leaf=lambda x: isinstance(x, PerReplica)
        )

    # ---------------------------------------------------------------- predict
    def _predict_batch(self, data):
        rows = _nonempty_rows(data, "`model.predict`")
        extended = self.strategy.extended
        n = extended.num_replicas_in_sync
        # Pad to the first batch's size (one compiled program for every batch,
        # the last included), rounded up to a multiple of the replica count.
        if self._predict_rows is None or rows > self._predict_rows:
            self._predict_rows = -(-rows // n) * n
        padded = jax.tree_util.tree_map(lambda x: pad_rows(np.asarray(x), self._predict_rows), data)
        # Every padded batch has the first one's layout: after it, its program is
        # called directly (``RepeatedSteps``), as ``fit``'s and ``evaluate``'s are.
        outputs = self._run_repeated("predict", padded, None)
        if outputs is MISSED:
            split = self._split(padded)
            outputs = self._run(self._replica_predict_step, split)
            self._learn_repeated(
                "predict", padded, _had_uneven(split), self._replica_predict_step, split
            )
        return jax.tree_util.tree_map(
            lambda v: predicted_rows(extended, v, rows),
            outputs,
            is_leaf=lambda x: isinstance(x, PerReplica),
        )

    def _replica_predict_step(self, data):
        model = self.model
        state = step_state(model, "predict")
        outputs, non_trainable_values = model.predict_step(state, data)
        # Kept, as Keras keeps them: a seed generator's state moves on with each predict.
        _assign(model.non_trainable_variables, non_trainable_values)
        return outputs


def _same_even_layout(splits) -> bool:
    """Whether split batches all have one even layout (one SPMD program takes them all)."""
    if any(_had_uneven(split) for split in splits):
        return False

    def layout(split):
        leaves, treedef = jax.tree_util.tree_flatten(
            split, is_leaf=lambda x: isinstance(x, PerReplica)
        )
        shapes = [np.shape(x.stacked if isinstance(x, PerReplica) else x) for x in leaves]
        return treedef, shapes

    first = layout(splits[0])
    return all(layout(split) == first for split in splits[1:])


def _nonempty_rows(data, caller) -> int:
    """The rows of a global batch; 0 rows would divide the loss scale by zero."""
    rows = batch_rows(data)
    if rows == 0:
        raise ValueError(
            f"{caller} received a batch with 0 rows from its dataset. Every "
            "batch needs at least one row: make the dataset (generator, PyDataset, "
            "...) skip empty batches. Received: batch shapes="
            f"{[np.shape(x) for x in jax.tree_util.tree_leaves(data)]}"
        )
    return rows


def _had_uneven(per_replica_logs) -> bool:
    return any(
        isinstance(v, PerReplica) and v.stacked is None
        for v in jax.tree_util.tree_leaves(
            per_replica_logs, is_leaf=lambda x: isinstance(x, PerReplica)
        )
    )


def _write_back(model, step, new_state):
    """Writes a step's new state into the variables (``step_state``'s order)."""
    groups = list(zip(step_variables(model, step), new_state))
    if step != "train":
        groups = groups[1:]  # the trainable weights come back as they went in
    for variables, values in groups:
        _assign(variables, values)


def _assign(variables, values):
    """Writes the state Keras's stateless step returned back into the variables.

    Mirrored state (weights, optimizer slots, counters) came out of the
    optimizer's single cross-replica update: every replica holds the same
    value, so it is written as it is, without the aggregation a replica's own
    write would get (an ``only_first_replica`` counter would cost a collective).
    """
    for variable, value in zip(variables, values):
        if isinstance(variable, MirroredVariable):
            variable.plain_write("assign", value)
        else:
            variable.assign(value)
