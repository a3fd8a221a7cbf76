"""Optimizer updates applied on the parameter servers, beside their variables.

While a scheduled function is traced, an optimizer's update is kept out of the
worker's program: ``GradientRouter`` takes the optimizer's clipped gradients,
and the program returns them. For each ps task holding updated variables,
``trace_update`` traces the optimizer's own update of those variables (weight
decay, then its update step, with the slots made beside them) into an
``UpdateProgram``, exported with ``jax.export`` and loaded on that task once
(``tasks/_loaded_update.py`` runs it there). A worker's step sends the
gradients in its one request per ps task, and the task runs the update on its
current values under its lock, as TF's ``ResourceApply*`` ops run on a ps
device. Concurrent workers' updates are applied one after the other on fresh
values: momentum and Adam's moments compose, and none is lost.

The values an update reads from other tasks (the iteration count, the
learning rate) are the worker's, as on TF's parameter servers. An update
that cannot run on one task runs on the worker, its writes sent as deltas so
that concurrent workers' slot updates add up: one with slots on another
task, gradient accumulation, EMA or constraints, or one inside ``cond``
(Keras's ``LossScaleOptimizer``). So does every update of a function that
reads an updated variable after the update, writes one (the learning rate,
say), or applies one optimizer twice: those need the updates in program
order. A partitioned variable's shards are updated each on its own task, as
TF's optimizers update each shard of a ``ShardedVariable`` as a variable of
its own.
"""

import hashlib
from typing import NamedTuple

import jax
import jax.numpy as jnp

from keras_dist._keras import RecordingScope
from keras_dist._keras import apply_update
from keras_dist._keras import clip_gradients
from keras_dist.parameter_server.rpc import _protocol as protocol
from keras_dist.parameter_server.variables._ps_variable import shard_shapes
from keras_dist.parameter_server.variables._trace import current_trace
from keras_dist.parameter_server.variables._trace import used_inputs


class OptimizerStep(NamedTuple):
    """One optimizer update taken during a trace, with what it needs from the worker."""

    optimizer: object
    variables: list
    grads: list
    snapshot: dict  # id(optimizer variable) -> its value before the update


class UpdateProgram(NamedTuple):
    """An optimizer's update of the variables (or shards) on one ps task, ready to send there.

    The program takes the values stored under ``held_keys`` on the task, the
    gradients of ``variables`` (their rows ``rows``, for shards), then ``sent``
    (values the worker sends), and returns the new values of ``held_keys[i]``
    for ``i`` in ``written``.
    """

    task: int
    update_id: str
    blob: bytes
    held: list  # the variables whose values the task reads (and maybe writes)
    held_keys: list  # their keys there (a shard's, for partitioned variables)
    written: list  # indices into held_keys
    variables: list  # the updated variables, in gradient order
    rows: list  # each variable's (start, stop) rows on this task, or None: all of it
    sent: list  # variables read on other tasks: the worker sends their values

    def header(self) -> dict:
        """The ``load_update`` request a ps task loads the program with."""
        return protocol.request(
            protocol.LOAD_UPDATE,
            update_id=self.update_id,
            held=self.held_keys,
            written=self.written,
        )

    def worker_values(self, step: OptimizerStep) -> list:
        """What the worker's program returns for this update: gradients, then sent values."""
        grads = {id(v): g for v, g in zip(step.variables, step.grads)}
        values = []
        for variable, rows in zip(self.variables, self.rows):
            grad = grads[id(variable)]
            values.append(grad if rows is None else grad[rows[0] : rows[1]])
        return values + [jnp.asarray(step.snapshot[id(v)]).astype(v.dtype) for v in self.sent]


def _shard(variable, index: "int | None"):
    """The shard ``index`` of a partitioned ``variable``, else its one shard (or ``None``)."""
    location = getattr(variable, "location", None)
    if location is None:
        return None
    shards = location.shards
    if len(shards) == 1:
        return shards[0]
    return shards[index] if index is not None and index < len(shards) else None


def _shape(variable, index: "int | None") -> tuple:
    """The shape of ``variable``'s shard ``index`` (its whole shape when unpartitioned)."""
    shard = _shard(variable, index)
    if shard is None or len(variable.location.shards) == 1:
        return tuple(variable.shape)
    return (shard.rows, *variable.shape[1:])


def _as_shards(variables, index: "int | None"):
    """Gives partitioned ``variables`` their shard's shape while an update is traced.

    As TF's optimizers update each shard of a ``ShardedVariable`` as a
    variable of its own, the update of shard ``index`` is traced with the
    variable and its slots at that shard's shape (Keras checks the shapes of
    what is assigned), on this thread only.
    """
    return shard_shapes({id(v): _shape(v, index) for v in variables})


class RoutingScope(RecordingScope):
    """A scheduled function's scope: notes reads of what an update on the ps changes.

    A value read after its update was taken for a ps task would be the value
    before the update: the function is then traced again with its updates
    made on the worker.
    """

    def __init__(self, mapping: dict):
        super().__init__(mapping)
        self.routed: set = set()  # ids of the variables and slots updated on the ps
        self.read_after_routing = False

    def get_current_value(self, variable):
        if id(variable) in self.routed:
            self.read_after_routing = True
        return super().get_current_value(variable)


class GradientRouter:
    """The ``routing_gradients`` handler of one trace: takes updates that can run on a ps."""

    def __init__(self, enabled: bool, scope: RoutingScope):
        self.enabled = enabled
        self.steps: list = []
        self._scope = scope
        self._trace_state = None

    @property
    def conflict(self) -> bool:
        """Whether the function uses what its updates on the ps change (or updates twice).

        It read a routed variable or slot after the update, or wrote one (the
        learning rate, say) anywhere in the function, or applied one optimizer
        twice: its updates must then run in order, on the worker.
        """
        scope = self._scope
        optimizers = {id(step.optimizer) for step in self.steps}
        return (
            scope.read_after_routing
            or bool(scope.routed & set(scope.assigned))
            or len(optimizers) < len(self.steps)
        )

    def start(self) -> None:
        """Called at the top of the traced function: updates in nested traces stay."""
        self._trace_state = jax.extend.core.get_opaque_trace_state()

    def __call__(self, optimizer, grads, variables) -> bool:
        on_ps = self.enabled and _can_run_on_ps(optimizer, variables)
        # Inside cond or grad the values cannot leave the program.
        if not on_ps or jax.extend.core.get_opaque_trace_state() != self._trace_state:
            trace = current_trace()
            if trace is not None:
                # Arithmetic updates add up as deltas; what is set (a constrained
                # weight, the learning rate, a loss scale) is overwritten.
                slots = [v for v in optimizer.variables if len(v.shape)]
                added = [v for v in variables if v.constraint is None]
                trace.deltas.update(id(v) for v in [*added, *slots])
            return False
        grads = clip_gradients(optimizer, grads)
        snapshot = {id(v): v.value for v in optimizer.variables}
        self.steps.append(OptimizerStep(optimizer, variables, list(grads), snapshot))
        counter = id(optimizer.iterations)  # still counted here, as a delta
        self._scope.routed.update(
            id(v) for v in [*variables, *optimizer.variables] if id(v) != counter
        )
        return True


def _can_run_on_ps(optimizer, variables) -> bool:
    if optimizer.gradient_accumulation_steps or optimizer.use_ema:
        return False
    if any(v.constraint is not None for v in variables):
        return False
    return all(_shard(v, 0) is not None for v in [*variables, *optimizer.variables])


def plan_updates(step: OptimizerStep) -> "list | None":
    """The ``UpdateProgram``s of one optimizer step (one per ps task and shard), or ``None``."""
    groups: dict = {}
    for variable, grad in zip(step.variables, step.grads):
        shards = variable.location.shards
        if len(shards) == 1:
            groups.setdefault((shards[0].task, -1), []).append((variable, grad, None))
            continue
        start = 0
        for index, shard in enumerate(shards):
            rows = (start, start + shard.rows)
            groups.setdefault((shard.task, index), []).append((variable, grad, rows))
            start += shard.rows
    programs = []
    for (task, index), pieces in sorted(groups.items()):
        program = trace_update(step.optimizer, task, None if index < 0 else index, pieces)
        if program is None:
            return None
        programs.append(program)
    return programs


def trace_update(optimizer, task: int, index: "int | None", pieces) -> "UpdateProgram | None":
    """The update on ps task ``task`` of ``pieces`` (variable, traced gradient, rows).

    ``index`` is the shard of partitioned variables this update is for, or ``None``.
    """
    variables = [v for v, _, _ in pieces]
    rows = [r for _, _, r in pieces]
    grad_specs = [jax.ShapeDtypeStruct(_shape(v, index), jnp.result_type(g)) for v, g, _ in pieces]
    updated = {id(v) for v in variables}
    candidates = variables + [v for v in optimizer.variables if id(v) not in updated]
    specs = [jax.ShapeDtypeStruct(_shape(v, index), v.dtype) for v in candidates]
    written_ids: list = []

    def probe(*flat):
        values, grads = flat[: len(candidates)], flat[len(candidates) :]
        with RecordingScope({id(v): x for v, x in zip(candidates, values)}) as scope:
            apply_update(optimizer, list(grads), variables)
        written_ids[:] = [id(v) for v in candidates if id(v) in scope.assigned]
        return [scope.state_mapping[i] for i in written_ids]

    with _as_shards(candidates, index):
        closed = jax.make_jaxpr(probe)(*specs, *grad_specs)
    read = used_inputs(closed.jaxpr, len(candidates))
    touched = [v for n, v in enumerate(candidates) if n in read or id(v) in written_ids]

    def task_of(variable):
        shard = _shard(variable, index)
        return None if shard is None else shard.task

    if any(task_of(v) != task for v in touched if id(v) in written_ids):
        return None  # a slot on another task: the update cannot be atomic there
    held = [v for v in touched if task_of(v) == task]
    sent = [v for v in touched if task_of(v) != task]
    if any(_shape(v, index) != tuple(v.shape) for v in sent):
        return None  # a shard of another task's variable: not the worker's to send
    written = [n for n, v in enumerate(held) if id(v) in written_ids]

    def update(*flat):
        held_values = flat[: len(held)]
        grads = flat[len(held) : len(held) + len(variables)]
        mapping = {id(v): x for v, x in zip(held, held_values)}
        mapping.update({id(v): x for v, x in zip(sent, flat[len(held) + len(variables) :])})
        with RecordingScope(mapping) as scope:
            apply_update(optimizer, list(grads), variables)
        return [
            jnp.asarray(scope.state_mapping[id(held[n])]).astype(held[n].dtype) for n in written
        ]

    update_specs = [jax.ShapeDtypeStruct(_shape(v, index), v.dtype) for v in held]
    update_specs += grad_specs + [jax.ShapeDtypeStruct(v.shape, v.dtype) for v in sent]
    with _as_shards(candidates, index):
        exported = jax.export.export(jax.jit(update), platforms=("cpu",))(*update_specs)
    blob = bytes(exported.serialize())
    held_keys = [_shard(v, index).key for v in held]
    update_id = hashlib.sha256(blob + "|".join(held_keys).encode()).hexdigest()[:24]
    return UpdateProgram(task, update_id, blob, held, held_keys, written, variables, rows, sent)
