"""Keras's training loops for a model created under a strategy.

Keras's JAX loops stay (callbacks, progress bar, History, validation,
``steps_per_execution``); the step functions, the state handling and the data
iterator come from keras_dist's training package, handed in as a
``TrainingIntegration`` when the hooks are installed (this package sits below
it). Internals used: the ``JAXTrainer`` loops and ``make_*_function``,
``_get_jax_state``, ``JAXEpochIterator._get_iterator`` and
``_enumerate_iterator``, ``Trainer.get_metrics_result`` and ``Trainer.compile``.
"""

import contextlib
import functools
import inspect
import threading
from typing import Protocol

import keras

from keras_dist import _context
from keras_dist._capabilities import MeshRuntime
from keras_dist._keras._callbacks import quiet_between_steps
from keras_dist._keras._callbacks import reads_batch_logs
from keras_dist._keras._callbacks import release_after_error
from keras_dist._keras._callbacks import runs_nothing_at
from keras_dist._keras._internals import CallbackList
from keras_dist._keras._internals import JAXEpochIterator
from keras_dist._keras._internals import JAXTrainer
from keras_dist._keras._internals import Trainer
from keras_dist._keras._internals import jax_trainer_module
from keras_dist._keras._loop_arguments import apply_auto_shard_policies
from keras_dist._keras._loop_arguments import read_to_the_end
from keras_dist._keras._loop_arguments import require_steps_for_endless_inputs
from keras_dist._keras._variable_hooks import is_strategy_distribution
from keras_dist._thread_state import set_for_block

_LOOPS = ("fit", "evaluate", "predict", "train_on_batch", "test_on_batch", "predict_on_batch")
_STEP_FUNCTIONS = (
    ("make_train_function", "train_function"),
    ("make_test_function", "test_function"),
    ("make_predict_function", "predict_function"),
)


class TrainingIntegration(Protocol):
    """What the trainer hooks ask of keras_dist's training package."""

    def model_strategy(self, model):
        """The strategy ``model`` was created or compiled under, or ``None``."""

    def check_fit_context(self, model) -> None:
        """Raises when a model built outside any strategy is trained inside a scope."""

    def make_steps(self, model, strategy):
        """An object with ``train_function``, ``test_function``, ``predict_function``."""

    def loop_input(self, data, strategy, shuffle=False, steps=None, names=("x", "steps_per_epoch")):
        """A loop's input (``x``, ``validation_data``) with its auto-shard policy applied
        (``kd.data.with_auto_shard_policy``; ``strategy`` is ``None`` without one);
        ``steps``: the loop's steps for it (``steps_per_epoch``; -1: to the data's end),
        ``names``: the input's argument and its steps' (for errors)."""

    def host_batches(self, batches, read_ahead: bool, in_memory: bool, layout: tuple):
        """Keras's host batches as ``fit`` iterates them: ``read_ahead`` where reading
        ahead loses nothing, ``in_memory`` for slices of arrays in memory.

        ``layout`` is ``(steps, batch_size, last_partial_batch_size)`` as Keras's
        data adapter knows them (``None`` where it does not).
        """

    def reading(self):
        """A context for one loop: readers it opened are closed when it ends, however."""

    def steps_run_on(self, quiet: bool):
        """A context for one loop: with ``quiet`` (nothing of the user's runs between two
        steps) a compiled step may still run when its step function returns."""

    def wait_for_steps(self) -> None:
        """Waits for a step still running (before Keras reads the metrics)."""


def _in_strategy() -> bool:
    return is_strategy_distribution(_context.keras_distribution())


def _wrap_loop(original, training, chief_checkpoint):
    """Runs a Keras loop in the model's strategy scope, so variables it creates are distributed."""

    signature = inspect.signature(original)

    @functools.wraps(original)
    def loop(self, *args, **kwargs):
        bound = signature.bind(self, *args, **kwargs)
        arguments = bound.arguments
        strategy = training.model_strategy(self)
        apply_auto_shard_policies(arguments, strategy, training, original.__name__)
        require_steps_for_endless_inputs(arguments)
        read_to_the_end(arguments)
        args, kwargs = bound.args[1:], bound.kwargs
        callbacks = arguments.get("callbacks")
        quiet = original.__name__ in ("fit", "evaluate") and quiet_between_steps(callbacks)
        run = LoopRun(original.__name__, exact_batch_logs=reads_batch_logs(callbacks))
        try:
            if original.__name__ == "fit":
                _keras_callbacks_across_processes(callbacks, strategy, chief_checkpoint)
                with _fitting_with(self, callbacks):
                    return _run_loop(self, original, training, quiet, run, args, kwargs)
            return _run_loop(self, original, training, quiet, run, args, kwargs)
        except BaseException:
            # Keras calls the end hooks only when its loop returns: the writers,
            # threads and files a callback holds are closed here instead.
            release_after_error(callbacks)
            raise

    loop._keras_dist_hook = True
    return loop


def _keras_callbacks_across_processes(callbacks, strategy, chief_checkpoint) -> None:
    """Keras's own file-writing callbacks in a job of several processes, where every
    worker would write the same files and they collide.

    ``ModelCheckpoint`` becomes ``chief_checkpoint`` (``kd.callbacks.ModelCheckpoint``,
    its subclass, same state): as tf.keras's, only the chief's file stays (every
    worker's writes had come out corrupt). ``BackupAndRestore`` is refused: kd's
    restores every worker from the chief's backup, which Keras's state does not carry.
    """
    if strategy is None or not strategy.extended.spans_processes:
        return
    for callback in callbacks if isinstance(callbacks, (list, tuple)) else ():
        if type(callback) is keras.callbacks.ModelCheckpoint:
            callback.__class__ = chief_checkpoint
        elif type(callback) is keras.callbacks.BackupAndRestore:
            raise ValueError(
                "keras.callbacks.BackupAndRestore has every worker write the same backup "
                "files, which collide across processes. Use kd.callbacks.BackupAndRestore "
                "(same arguments): the chief writes the backup and every worker restores "
                f"from it, as tf.keras's did. Received: {callback!r}"
            )


@contextlib.contextmanager
def _fitting_with(model, callbacks):
    """Lets a callback see its siblings during ``fit`` (``fit_callbacks``)."""
    previous = getattr(model, "_keras_dist_fit_callbacks", ())
    object.__setattr__(model, "_keras_dist_fit_callbacks", tuple(callbacks or ()))
    try:
        yield
    finally:
        object.__setattr__(model, "_keras_dist_fit_callbacks", previous)


def fit_callbacks(model) -> tuple:
    """The callbacks passed to the ``fit`` that ``model`` is running (empty outside one).

    ``BackupAndRestore`` saves what the others remember (``ModelCheckpoint``'s best).
    """
    return getattr(model, "_keras_dist_fit_callbacks", ())


class LoopRun:
    """One call of a Keras loop (``fit``, ``train_on_batch``, ...) under a strategy.

    ``exact_batch_logs``: a callback reads each batch's own logs at its end
    (``reads_batch_logs``), so steps that run asynchronously are waited for one by one.
    """

    __slots__ = ("name", "exact_batch_logs")

    def __init__(self, name: str, exact_batch_logs: bool = False):
        self.name = name
        self.exact_batch_logs = exact_batch_logs


class _RunningLoop(threading.local):
    run = None  # the ``LoopRun`` on this thread


_running_loop = _RunningLoop()


def running_loop():
    """The ``LoopRun`` running on this thread under a strategy, or ``None``.

    Steps that run asynchronously (a parameter server's) keep their logs per run (a
    recompiled model's logs have other names), and ``*_on_batch`` wait for their own.
    """
    return _running_loop.run


def _run_loop(self, original, training, quiet, run, args, kwargs):
    strategy = training.model_strategy(self)
    if strategy is None:
        training.check_fit_context(self)
        return original(self, *args, **kwargs)
    with set_for_block(_running_loop, "run", run):
        return _run_loop_in(self, strategy, original, training, quiet, args, kwargs)


def _run_loop_in(self, strategy, original, training, quiet, args, kwargs):
    # One loop at a time per strategy: its steps donate the variables they
    # write, so another thread's step would delete this one's buffers.
    with strategy.extended.lock:
        if original.__name__ == "fit":
            # Keras shuffles with NumPy's global generator: across processes
            # every worker must draw the same order (it keeps its replicas'
            # pieces of each global batch).
            if isinstance(strategy.extended, MeshRuntime):
                strategy.extended.agree_on_host_random_state()
        with strategy.scope(), training.reading(), training.steps_run_on(quiet):
            return original(self, *args, **kwargs)


def execution_batches(model, iterator) -> list:
    """The batches of one execution of a Keras step function: ``steps_per_execution`` of them.

    Fewer at the end of the data. ``StopIteration`` on the first ends the epoch
    (Keras's loop catches it).
    """
    batches = [next(iterator)]
    for _ in range(model.steps_per_execution - 1):
        try:
            batches.append(next(iterator))
        except StopIteration:
            break
    return batches


def _steps(model, strategy, training):
    steps = getattr(model, "_keras_dist_steps", None)
    if steps is None or steps.strategy is not strategy:
        steps = training.make_steps(model, strategy)
        object.__setattr__(model, "_keras_dist_steps", steps)
    return steps


def _wrap_make_function(original, attribute, training):
    @functools.wraps(original)
    def make_function(self, force=False):
        strategy = training.model_strategy(self)
        if strategy is None:
            return original(self, force)
        if getattr(self, attribute) is None or force:
            setattr(self, attribute, getattr(_steps(self, strategy, training), attribute))
        return getattr(self, attribute)

    return make_function


def _wrap_get_jax_state(original, training):
    @functools.wraps(original)
    def get_jax_state(self, **groups):
        if training.model_strategy(self) is None:
            return original(self, **groups)
        # Our steps read and write the variables themselves: an empty list per
        # requested group keeps Keras's unpacking and syncing no-ops.
        wanted = ("trainable_variables", "non_trainable_variables")
        wanted += ("optimizer_variables", "metrics_variables")
        return tuple([] for name in wanted if groups.get(name))

    return get_jax_state


def _wrap_get_iterator(original, training):
    @functools.wraps(original)
    def get_iterator(self):
        if _in_strategy():
            # Host batches: the strategy splits and places them itself. They may be
            # read ahead, except from a generator or an input of unknown length
            # (Keras may start a new epoch on the same iterator: batches read ahead
            # would be lost, and a PyDataset refuses reads after its epoch ended).
            # Arrays in memory are not read from a thread: a slice waits on nothing,
            # and handing it over costs more than it takes (~50 µs a step on CPU).
            adapter = self.data_adapter
            batches = adapter.get_numpy_iterator()
            kind = type(adapter).__name__
            read_ahead = kind != "GeneratorDataAdapter"
            read_ahead = read_ahead and _known(adapter, "num_batches") is not None
            partial = _known(adapter, "has_partial_batch")
            layout = (
                self.steps_per_epoch or _known(adapter, "num_batches"),
                _known(adapter, "batch_size"),
                _known(adapter, "partial_batch_size") if partial else 0,
            )
            in_memory = kind == "ArrayDataAdapter"
            return training.host_batches(batches, read_ahead, in_memory, layout)
        return original(self)

    return get_iterator


def _known(adapter, name):
    """A data adapter's property, or ``None`` where the adapter cannot tell."""
    try:
        return getattr(adapter, name)
    except NotImplementedError:
        return None


def _wrap_distribute_data(original):
    """``*_on_batch`` hand host arrays to our steps, which split and place them.

    Keras places an ``*_on_batch`` batch with the current distribution's data layout;
    a strategy's distribution has none (its steps split each batch between replicas).
    """

    @functools.wraps(original)
    def distribute_data(data, layouts=None):
        if _in_strategy():
            return data
        return original(data, layouts)

    return distribute_data


def _wrap_enumerate_iterator(original):
    """The last execution of an epoch ends at the epoch's last batch, as in tf-keras.

    Keras 3 runs and reports ``steps_per_execution`` steps even when the epoch
    ends sooner: with ``steps_per_epoch=50`` and ``steps_per_execution=20`` on
    data that goes on, its first epoch trains 60 steps and ends at batch 59.
    tf-keras's last execution runs the epoch's 10 remaining steps and ends at 49:
    the execution is handed only those batches, and Keras's count of the batches
    read (which ends the data's pass) counts only those.
    """

    @functools.wraps(original)
    def enumerate_iterator(self):
        steps = self.steps_per_epoch or self._num_batches
        for begin_step, end_step, iterator in original(self):
            if steps and _in_strategy() and end_step >= steps:
                self._steps_seen -= end_step - (steps - 1)
                end_step = steps - 1
                iterator = _FirstBatches(iterator, end_step - begin_step + 1)
            yield begin_step, end_step, iterator

    return enumerate_iterator


class _FirstBatches:
    """The first ``count`` batches of ``iterator`` (the rest stay there for the next epoch)."""

    def __init__(self, iterator, count: int):
        self._iterator = iterator
        self._left = count

    def __iter__(self):
        return self

    def __next__(self):
        if self._left <= 0:
            raise StopIteration
        self._left -= 1
        return next(self._iterator)


def _wrap_get_metrics_result(original, training):
    @functools.wraps(original)
    def get_metrics_result(self):
        training.wait_for_steps()  # the metrics are a running step's results
        frame = _context.current_frame()
        replica_context = frame.replica_context
        if replica_context is not None and frame.engine is not None and frame.engine.compiled:
            # As tf.keras's metric results: read in a merge_call, aggregated.
            return replica_context.merge_call(lambda _: original(self))
        return original(self)

    return get_metrics_result


def _wrap_compile(original, training):
    @functools.wraps(original)
    def compile(self, *args, **kwargs):
        # Steps built for the last compile know its losses and metrics: build new ones.
        object.__setattr__(self, "_keras_dist_steps", None)
        if _context.has_strategy():
            if _context.strategy_in_effect() is not None:
                object.__setattr__(self, "_keras_dist_strategy", _context.get_strategy())
            return original(self, *args, **kwargs)
        strategy = training.model_strategy(self)
        if strategy is None:
            return original(self, *args, **kwargs)
        # As tf.keras: a model created in a scope compiles in it, so the optimizer and
        # the metrics are the strategy's wherever `compile` is called.
        with strategy.scope():
            return original(self, *args, **kwargs)

    return compile


def _wrap_init(original):
    @functools.wraps(original)
    def __init__(self, *args, **kwargs):
        original(self, *args, **kwargs)
        # As tf.keras: a model created in a scope belongs to its strategy, even before it
        # has variables (a subclassed model built by its first `predict`).
        strategy = _context.strategy_in_effect()
        if strategy is not None:
            object.__setattr__(self, "_keras_dist_strategy", strategy)

    return __init__


# What each of ``CallbackList``'s batch-end hooks calls on every callback.
_BATCH_END_CALLS = {
    "on_train_batch_end": ("on_train_batch_end", "on_batch_end"),  # the first calls the second
    "on_test_batch_end": ("on_test_batch_end",),
    "on_predict_batch_end": ("on_predict_batch_end",),
}


def _wrap_batch_end(original, calls):
    """Skips a batch-end dispatch in a strategy's loop when no callback does anything there.

    Keras hands every batch's end to a thread (``_async_dispatch``) that copies the
    logs to the host and calls each callback's hook, even when every hook is
    ``Callback``'s empty default (``History``, ``EarlyStopping``, ``verbose=0``):
    a thread hop and a copy per step for nothing, 5-10% of a small model's step on
    a CPU. With a callback that overrides one of these hooks (the progress bar,
    ``TensorBoard``, a user's), Keras's dispatch runs as always.
    """

    @functools.wraps(original)
    def on_batch_end(self, batch, logs=None):
        if _in_strategy() and all(runs_nothing_at(c, calls) for c in self.callbacks):
            return None
        return original(self, batch, logs)

    return on_batch_end


def compiled_under(model):
    """The strategy current when ``model`` was created or compiled, or ``None``."""
    return getattr(model, "_keras_dist_strategy", None)


def install_trainer_hook(training: TrainingIntegration, chief_checkpoint: type) -> None:
    """Routes the training loops of models created under a strategy through ``training``.

    ``chief_checkpoint`` is the ``keras.callbacks.ModelCheckpoint`` subclass a Keras
    one becomes in a job of several processes (``kd.callbacks``, a package above).
    """
    if getattr(JAXTrainer.fit, "_keras_dist_hook", False):
        return
    for name in _LOOPS:
        loop = _wrap_loop(getattr(JAXTrainer, name), training, chief_checkpoint)
        setattr(JAXTrainer, name, loop)
    for name, attribute in _STEP_FUNCTIONS:
        setattr(
            JAXTrainer, name, _wrap_make_function(getattr(JAXTrainer, name), attribute, training)
        )
    JAXTrainer._get_jax_state = _wrap_get_jax_state(JAXTrainer._get_jax_state, training)
    jax_trainer_module._distribute_data = _wrap_distribute_data(jax_trainer_module._distribute_data)
    JAXEpochIterator._get_iterator = _wrap_get_iterator(JAXEpochIterator._get_iterator, training)
    JAXEpochIterator._enumerate_iterator = _wrap_enumerate_iterator(
        JAXEpochIterator._enumerate_iterator
    )
    for name, calls in _BATCH_END_CALLS.items():
        setattr(CallbackList, name, _wrap_batch_end(getattr(CallbackList, name), calls))
    Trainer.get_metrics_result = _wrap_get_metrics_result(Trainer.get_metrics_result, training)
    Trainer.compile = _wrap_compile(Trainer.compile, training)
    Trainer.__init__ = _wrap_init(Trainer.__init__)
