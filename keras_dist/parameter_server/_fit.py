"""``fit``, ``evaluate`` and ``predict`` on parameter servers (coordinator mode).

Keras's loops stay (callbacks on the coordinator, progress bar, validation);
each step is scheduled onto a free worker through the strategy's
``ClusterCoordinator``: Keras's own stateless ``train_step`` runs there on
values read from the ps tasks. Its optimizer update is applied by the ps
tasks holding the weights (``_ps._apply``), and the rest of its new state
goes back as deltas that the ps tasks add (counters, metric totals), so
workers running steps at once all count: ``optimizer.iterations`` ends at
epochs × steps exactly. In between-graph mode (a worker task running the
program itself) the steps run in the worker's own process, asynchronously
with the other workers. Statistics of non-trainable layers (batch norm) are
overwritten, last writer wins. Steps run asynchronously; any read of a
variable on the coordinator (metrics at the end of an epoch, a callback that
reads weights) first waits for the scheduled steps.

TF 2.21 with Keras 3 cannot run ``model.fit`` under ParameterServerStrategy
at all; here NumPy, ``PyDataset``, Grain and generators work as with any
strategy (the coordinator reads the batches and sends each to a worker), and
a ``kd.experimental.DatasetCreator`` is read by every worker from its own
pipeline.
"""

import weakref

import jax
import numpy as np

from keras_dist import errors
from keras_dist._keras import execution_batches
from keras_dist._keras import running_loop
from keras_dist._keras import step_state
from keras_dist.parameter_server._data import FromWorkers
from keras_dist.parameter_server.scheduling._between_graph import LocalScheduler
from keras_dist.parameter_server.scheduling._cluster_coordinator import ClusterCoordinator
from keras_dist.parameter_server.scheduling._remote_value import raisable


def _write_state(groups, old_state, new_state, kinds=("add", "set", "add", "add")) -> None:
    """Writes Keras's new state: increments, so concurrent workers' steps compose.

    A value Keras left as it was is not written (nor read again: the
    variables an optimizer updates on the ps tasks come back unchanged, and
    their update is sent as gradients instead). Statistics of non-trainable
    layers (batch norm) are overwritten.
    """
    for variables, old, new, kind in zip(groups, old_state, new_state, kinds):
        for variable, before, after in zip(variables, old, new):
            if after is before:
                continue
            if kind == "set":
                variable.assign(after)
            else:
                variable.assign_add(after - before)


def _fetch(remote_value):
    """A step's logs; a step cancelled by an earlier failure raises that failure.

    ``fit`` reports why its steps stopped (a lost ps task, say), as ``join``
    would, rather than the cancellation of whichever step it waited for.
    """
    try:
        return remote_value.fetch()
    except errors.CancelledError as cancelled:
        if isinstance(cancelled.__cause__, errors.OpError):
            raise raisable(cancelled.__cause__) from None  # the original stays kept
        raise


def _from_workers(batch) -> bool:
    leaves = jax.tree_util.tree_leaves(batch)
    return bool(leaves) and isinstance(leaves[0], FromWorkers)


class ParameterServerSteps:
    """The train/test/predict functions Keras's loops call under ParameterServerStrategy."""

    def __init__(self, model, strategy):
        # Weakly: the strategy keeps these steps per model, and a model dropped by
        # the user must be freed (its variables on the ps tasks with it).
        self._model = weakref.ref(model)
        self.strategy = strategy
        extended = strategy.extended
        if extended.experimental_between_graph:
            # A worker running the program itself runs its steps here.
            self.coordinator = LocalScheduler(strategy, extended.worker_index)
        else:
            self.coordinator = ClusterCoordinator(strategy)
        self._pending: list = []
        self._last_logs = None
        self._logs_run = None  # the Keras loop run ``_last_logs`` came from
        self._iterators: dict = {}

    @property
    def model(self):
        model = self._model()
        if model is None:
            raise RuntimeError("The model of these steps was deleted.")
        return model

    # Keras's loops call ``fn(state, iterator)`` and unpack ``(logs, state)``.
    def train_function(self, state, iterator):
        steps = (self._train_steps, self._train_steps_on_worker_data)
        return self._schedule(steps, iterator), state

    def test_function(self, state, iterator):
        steps = (self._test_steps, self._test_steps_on_worker_data)
        return self._schedule(steps, iterator), state

    def predict_function(self, state, iterator):
        batches = tuple(self._batches(iterator))
        if any(_from_workers(b) for b in batches):
            raise ValueError(
                "`model.predict` under ParameterServerStrategy takes data read here (arrays, "
                "a dataset or a generator), not a `DatasetCreator`: batches read on the "
                "workers would come back in no defined order, so the predictions could not "
                "be matched to their inputs. Pass the inputs to predict instead. Received: "
                "a DatasetCreator"
            )
        outputs = self.coordinator.schedule(self._predict_steps, args=(batches,)).fetch()
        if len(outputs) == 1:
            return outputs[0], state
        return jax.tree_util.tree_map(lambda *xs: np.concatenate(xs), *outputs), state

    def _batches(self, iterator) -> list:
        batches = execution_batches(self.model, iterator)
        return [b if _from_workers(b) else jax.tree_util.tree_map(np.asarray, b) for b in batches]

    def _schedule(self, steps, iterator):
        """Schedules one execution's steps (``steps_per_execution`` batches) as one
        function; returns the logs of the latest execution that finished.

        As TF's multi-step train function, a worker runs them in one closure: one
        request, the variables read once and the updates sent once for all of them.
        """
        self.strategy.extended.set_settle(weakref.WeakMethod(self.settle))
        # A loop never returns logs of an earlier one (a recompiled model's have other
        # names): that loop's steps still queued are waited for first, their logs dropped.
        run = running_loop()
        if run is not self._logs_run:
            while self._pending:
                _fetch(self._pending.pop(0))
            self._logs_run, self._last_logs = run, None
        batches = self._batches(iterator)
        if _from_workers(batches[0]):
            # A DatasetCreator: the worker reads the batches from its own pipeline.
            creator = jax.tree_util.tree_leaves(batches[0])[0].creator
            args = (self._per_worker_iterator(creator), len(batches))
            self._pending.append(self.coordinator.schedule(steps[1], args=args))
        else:
            self._pending.append(self.coordinator.schedule(steps[0], args=(tuple(batches),)))
        # Enough steps queued to keep every worker busy; older ones are waited for.
        # ``train_on_batch`` and ``test_on_batch`` return their own batch's logs, and
        # so does each step when a callback reads a batch's logs at its end.
        own_logs = run is not None and (run.name.endswith("_on_batch") or run.exact_batch_logs)
        limit = 0 if own_logs else 2 * self.strategy.extended.num_workers
        try:
            while len(self._pending) > limit or (self._last_logs is None and self._pending):
                self._last_logs = _fetch(self._pending.pop(0))
            while self._pending and self._pending[0].done:
                self._last_logs = _fetch(self._pending.pop(0))
        except errors.OpError:
            self._pending.clear()  # the failed fit's steps: nothing waits for them now
            raise
        return self._last_logs

    def _per_worker_iterator(self, creator):
        """One iterator per ``DatasetCreator`` on every worker, kept across epochs (TF's)."""
        iterator = self._iterators.get(id(creator))
        if iterator is None or iterator[0] is not creator:
            if not isinstance(self.coordinator, ClusterCoordinator):
                raise ValueError(
                    "A `DatasetCreator` is read by the workers of a `ClusterCoordinator`; a "
                    "worker running the program itself (between-graph) takes NumPy arrays or "
                    f"a PyDataset. Received: {creator!r}"
                )
            dataset = self.coordinator.create_per_worker_dataset(creator.dataset_fn)
            iterator = self._iterators[id(creator)] = (creator, iter(dataset))
        return iterator[1]

    def settle(self) -> None:
        """Waits for every scheduled step (before the coordinator reads a variable)."""
        if self._pending:
            pending, self._pending = self._pending, []
            self.coordinator.join()
            self._last_logs = pending[-1].fetch()

    # ------------------------------------------------ run on the workers
    def _train_step(self, data):
        model = self.model
        state = step_state(model, "train")
        logs, new_state = model.train_step(state, data)
        groups = (
            model.trainable_variables,
            model.non_trainable_variables,
            model.optimizer.variables,
            model.metrics_variables,
        )
        _write_state(groups, state, new_state)
        return logs

    def _train_steps(self, batches):
        return [self._train_step(data) for data in batches][-1]

    def _train_steps_on_worker_data(self, iterator, count):
        return [self._train_step(next(iterator)) for _ in range(count)][-1]

    def _test_steps(self, batches):
        return [self._test_step(data) for data in batches][-1]

    def _test_steps_on_worker_data(self, iterator, count):
        return [self._test_step(next(iterator)) for _ in range(count)][-1]

    def _test_step(self, data):
        model = self.model
        state = step_state(model, "test")
        logs, new_state = model.test_step(state, data)
        groups = (model.non_trainable_variables, model.metrics_variables)
        _write_state(groups, state[1:], new_state[1:], ("set", "add"))
        return logs

    def _predict_steps(self, batches):
        return [self._predict_step(data) for data in batches]

    def _predict_step(self, data):
        model = self.model
        state = step_state(model, "predict")
        outputs, non_trainable = model.predict_step(state, data)
        # As Keras's predict: the layers' state moves on (a seed generator's, so
        # that a dropout kept on at inference draws a new mask each call).
        _write_state((model.non_trainable_variables,), state[1:2], (non_trainable,), ("set",))
        return outputs
