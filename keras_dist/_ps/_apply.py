"""Optimizer updates applied on the parameter servers, beside their variables.

While a scheduled function is traced, an optimizer's update is kept out of
the worker's program: ``GradientRouter`` takes the optimizer's clipped
gradients, and the program returns them. For each ps task holding updated
variables, ``trace_update`` traces the optimizer's own update of those
variables (weight decay, then its update step, with the slots made beside
them) into an ``UpdateProgram``, exported with ``jax.export`` and loaded on
that task once. A worker's step sends the gradients in its one request per ps
task, and the task runs the update on its current values under its lock, as
TF's ``ResourceApply*`` ops run on a ps device. Concurrent workers' updates
are applied one after the other on fresh values: momentum and Adam's moments
compose, and none is lost.

The values an update reads from other tasks (the iteration count, the
learning rate) are the worker's, as on TF's parameter servers. An update
that cannot run on one task runs on the worker, its writes sent as deltas so
that concurrent workers' slot updates add up: a partitioned variable's, one
with slots on another task, gradient accumulation, EMA or constraints, or
one inside ``cond`` (Keras's ``LossScaleOptimizer``).
"""

import hashlib
from typing import NamedTuple

import jax
import jax.numpy as jnp

from keras_dist._keras import RecordingScope
from keras_dist._keras import apply_update
from keras_dist._keras import clip_gradients
from keras_dist._ps._trace import current_trace
from keras_dist._ps._trace import used_inputs


class OptimizerStep(NamedTuple):
    """One optimizer update taken during a trace, with what it needs from the worker."""

    optimizer: object
    variables: list
    grads: list
    snapshot: dict  # id(optimizer variable) -> its value before the update


class UpdateProgram(NamedTuple):
    """An optimizer's update of the variables on one ps task, ready to send there.

    The program takes ``held`` (values stored on the task), the gradients of
    ``variables``, then ``sent`` (values the worker sends), and returns the
    new values of ``held[i]`` for ``i`` in ``written``.
    """

    task: int
    update_id: str
    blob: bytes
    held: list  # variables whose values the task reads (and maybe writes)
    written: list  # indices into held
    variables: list  # the updated variables, in gradient order
    sent: list  # variables read on other tasks: the worker sends their values

    def header(self) -> dict:
        """The ``load_update`` request a ps task loads the program with."""
        return {
            "op": "load_update",
            "update_id": self.update_id,
            "held": [v.location.shards[0].key for v in self.held],
            "written": self.written,
        }

    def worker_values(self, step: OptimizerStep) -> list:
        """What the worker's program returns for this update: gradients, then sent values."""
        grads = {id(v): g for v, g in zip(step.variables, step.grads)}
        values = [grads[id(v)] for v in self.variables]
        return values + [jnp.asarray(step.snapshot[id(v)]).astype(v.dtype) for v in self.sent]


def _task(variable) -> "int | None":
    """The one ps task holding ``variable``, or ``None`` (not a ps variable, or sharded)."""
    location = getattr(variable, "location", None)
    if location is None or len(location.shards) != 1:
        return None
    return location.shards[0].task


class GradientRouter:
    """The ``routing_gradients`` handler of one trace: takes updates that can run on a ps."""

    def __init__(self, enabled: bool):
        self.enabled = enabled
        self.steps: list = []
        self._trace_state = None

    def start(self) -> None:
        """Called at the top of the traced function: updates in nested traces stay."""
        self._trace_state = jax.extend.core.get_opaque_trace_state()

    def __call__(self, optimizer, grads, variables) -> bool:
        on_ps = self.enabled and _can_run_on_ps(optimizer, variables)
        # Inside cond or grad the values cannot leave the program.
        if not on_ps or jax.extend.core.get_opaque_trace_state() != self._trace_state:
            trace = current_trace()
            if trace is not None:
                trace.deltas.update(id(v) for v in [*variables, *optimizer.variables])
            return False
        grads = clip_gradients(optimizer, grads)
        snapshot = {id(v): v.value for v in optimizer.variables}
        self.steps.append(OptimizerStep(optimizer, variables, list(grads), snapshot))
        return True


def _can_run_on_ps(optimizer, variables) -> bool:
    if optimizer.gradient_accumulation_steps or optimizer.use_ema:
        return False
    if any(v.constraint is not None for v in variables):
        return False
    return all(_task(v) is not None for v in [*variables, *optimizer.variables])


def plan_updates(step: OptimizerStep) -> "list | None":
    """The ``UpdateProgram``s of one optimizer step (one per ps task), or ``None``."""
    by_task: dict = {}
    for variable, grad in zip(step.variables, step.grads):
        by_task.setdefault(_task(variable), []).append((variable, grad))
    programs = []
    for task, pairs in sorted(by_task.items()):
        program = trace_update(step.optimizer, task, pairs)
        if program is None:
            return None
        programs.append(program)
    return programs


def trace_update(optimizer, task: int, pairs) -> "UpdateProgram | None":
    """The update of ``pairs`` (variable, traced gradient) on ps task ``task``."""
    variables = [v for v, _ in pairs]
    grad_specs = [jax.ShapeDtypeStruct(jnp.shape(g), jnp.result_type(g)) for _, g in pairs]
    updated = {id(v) for v in variables}
    candidates = variables + [v for v in optimizer.variables if id(v) not in updated]
    specs = [jax.ShapeDtypeStruct(v.shape, v.dtype) for v in candidates]
    written_ids: list = []

    def probe(*flat):
        values, grads = flat[: len(candidates)], flat[len(candidates) :]
        with RecordingScope({id(v): x for v, x in zip(candidates, values)}) as scope:
            apply_update(optimizer, list(grads), variables)
        written_ids[:] = [id(v) for v in candidates if id(v) in scope.assigned]
        return [scope.state_mapping[i] for i in written_ids]

    closed = jax.make_jaxpr(probe)(*specs, *grad_specs)
    read = used_inputs(closed.jaxpr, len(candidates))
    touched = [v for n, v in enumerate(candidates) if n in read or id(v) in written_ids]
    if any(_task(v) != task for v in touched if id(v) in written_ids):
        return None  # a slot on another task: the update cannot be atomic there
    held = [v for v in touched if _task(v) == task]
    sent = [v for v in touched if _task(v) != task]
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

    update_specs = [jax.ShapeDtypeStruct(v.shape, v.dtype) for v in held]
    update_specs += grad_specs + [jax.ShapeDtypeStruct(v.shape, v.dtype) for v in sent]
    exported = jax.export.export(jax.jit(update), platforms=("cpu",))(*update_specs)
    blob = bytes(exported.serialize())
    keys = "|".join(v.location.shards[0].key for v in held).encode()
    update_id = hashlib.sha256(blob + keys).hexdigest()[:24]
    return UpdateProgram(task, update_id, blob, held, written, variables, sent)


class LoadedUpdate:
    """An ``UpdateProgram`` on its ps task: ``run`` gives the new values to store."""

    def __init__(self, header: dict, blob: bytes):
        exported = jax.export.deserialize(bytearray(blob))
        self.held = list(header["held"])
        self.written = list(header["written"])
        self._call = jax.jit(exported.call)
        self._cpu = jax.devices("cpu")[0]

    def run(self, held_values: list, arrays: list) -> list:
        """``[(key, new value)]`` from the stored ``held_values`` and the worker's arrays."""
        with jax.default_device(self._cpu):
            outputs = self._call(*held_values, *arrays)
        # Kept as JAX arrays: the next update takes them without a copy.
        return [(self.held[n], out) for n, out in zip(self.written, outputs)]
