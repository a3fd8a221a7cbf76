"""A scheduled function traced on the coordinator into a program the workers run.

TF traces a ``tf.function`` on the coordinator and sends its graph to the
workers. Here ``fn`` (any Python callable) is traced with ``jax`` into one
pure program per input signature:

    (variable values, array arguments, per-worker iterator elements,
     worker index) -> (results, variable writes)

and serialized with ``jax.export``. A worker deserializes it once, then each
run is: read the variables it uses from the ps tasks, run it, send its writes
back (one request per ps task each way). No user Python object is sent.
An optimizer's update is applied on the ps tasks holding its variables
(``_update_tracing``): the program returns its gradients. Other writes made only by
``assign_add``/``assign_sub`` are sent as deltas that the ps adds atomically
(a counter bumped by N closures on N workers ends at N); others overwrite.

A first trace (``jax.make_jaxpr``) finds which variables the function reads
or writes, how often it calls ``next()`` on each iterator and its output
structure; the exported program then takes only the variables it uses.
"""

import itertools
import threading
import uuid
import weakref

import jax
import jax.numpy as jnp
import numpy as np

from keras_dist._engine._function_key import key_of
from keras_dist._engine._key_parts import static_key
from keras_dist._keras import on_unbuilt_apply
from keras_dist._keras import routing_gradients
from keras_dist._keras import variable_has_value
from keras_dist.parameter_server.rpc import _protocol as protocol
from keras_dist.parameter_server.scheduling._per_worker import PerWorkerIterator
from keras_dist.parameter_server.scheduling._per_worker import PerWorkerValues
from keras_dist.parameter_server.scheduling._per_worker import TracedIterator
from keras_dist.parameter_server.scheduling._remote_value import RemoteValue
from keras_dist.parameter_server.scheduling._update_tracing import GradientRouter
from keras_dist.parameter_server.scheduling._update_tracing import RoutingScope
from keras_dist.parameter_server.scheduling._update_tracing import plan_updates
from keras_dist.parameter_server.variables._trace import ProgramTrace
from keras_dist.parameter_server.variables._trace import tracing
from keras_dist.parameter_server.variables._trace import used_inputs

_program_ids = itertools.count()


class Program:
    """One traced signature of a scheduled function, ready to send to workers."""

    def __init__(self, blob, variables, writes, out_tree, iterator_counts, updates):
        self.program_id = f"program{next(_program_ids)}"
        self.blob = blob
        self._variables = [weakref.ref(v) for v in variables]
        # What its runs read or write on the ps tasks: a call keeps them alive.
        held = [v for u in updates for v in [*u.held, *u.sent]]
        self._uses = [weakref.ref(v) for v in [*variables, *held]]
        self.locations = [v.location for v in variables]
        self.writes = writes  # [(index into variables, kind)]
        self.out_tree = out_tree
        self.iterator_counts = iterator_counts  # next() calls per iterator argument
        self.n_results = out_tree.num_leaves
        # [(ps task, update id, how many arrays the program returns for it)]
        self.updates = [(u.task, u.update_id, len(u.variables) + len(u.sent)) for u in updates]

    def used_variables(self) -> "list | None":
        """The variables its runs use, or ``None`` once one was freed (its id may come back)."""
        used = [ref() for ref in self._uses]
        return None if any(v is None for v in used) else used

    def header(self) -> dict:
        """What a worker needs besides the serialized program."""
        return protocol.request(
            protocol.LOAD,
            program_id=self.program_id,
            variables=[loc.as_json() for loc in self.locations],
            writes=[list(w) for w in self.writes],
            n_results=self.n_results,
            updates=[list(u) for u in self.updates],
        )

    def results(self, flat):
        """The function's result, rebuilt from the flat arrays a worker sent back."""
        return jax.tree_util.tree_unflatten(self.out_tree, list(flat))


_RUN_ID_PREFIX = uuid.uuid4().hex[:16]  # this coordinator process's calls
_RUN_IDS = itertools.count()


class Call:
    """One scheduled call: its program, array arguments and per-worker inputs."""

    def __init__(self, program, args, per_worker_args, iterators, epoch=None, keep=()):
        self.program = program
        # The variables the program uses, held until the call has run: a model
        # dropped while its steps are queued is freed on the ps tasks only after.
        self.keep = keep
        self.epoch = epoch  # the coordinator's consistency epoch when scheduled
        self.args = args  # [(position, array)] the same for every worker
        self.per_worker_args = per_worker_args  # [(position, PerWorkerValues)]
        self.iterators = iterators  # [(PerWorkerIterator, count)]
        # Names this call's step on the ps tasks: when its worker is lost after
        # some ps applied it, the run on another worker is not applied twice.
        self.run_id = f"{_RUN_ID_PREFIX}-{next(_RUN_IDS)}"

    def arrays_for(self, worker_index: int) -> list:
        """The program's array arguments as worker ``worker_index`` takes them."""
        arrays = dict(self.args)
        for position, values in self.per_worker_args:
            arrays[position] = np.asarray(values.values[worker_index])
        return [arrays[i] for i in sorted(arrays)]


def _is_special(x) -> bool:
    return isinstance(x, (PerWorkerValues, PerWorkerIterator, RemoteValue))


class ProgramCache:
    """The programs traced for one strategy, by function and input signature."""

    def __init__(self, strategy):
        self._strategy = strategy
        self._programs: dict = {}
        self._lock = threading.Lock()
        self.traces = 0  # how many programs were traced (tests count retraces)
        # Programs freed here (their function or variables are gone): each worker
        # that loaded one is told to drop it with its next request. An id leaves
        # the set once no worker holds it (it stays bounded however many models
        # come and go); ``_holders`` says which workers loaded each program.
        self._dropped: set = set()
        self._holders: dict = {}  # program id -> indices of the workers holding it

    @property
    def dropped(self) -> set:
        """The ids of programs freed on the coordinator, which workers may still hold.

        The live set (read it, don't change it): ``finalize`` callbacks add to it.
        """
        return self._dropped

    def loaded(self, program_id: str, worker: int) -> None:
        """Worker ``worker`` now holds the program."""
        with self._lock:
            self._holders.setdefault(program_id, set()).add(worker)

    def unloaded(self, program_ids, worker: int) -> None:
        """Worker ``worker`` dropped these programs (or restarted and lost them)."""
        with self._lock:
            for program_id in program_ids:
                holders = self._holders.get(program_id)
                if holders is None:
                    continue
                holders.discard(worker)
                if not holders:
                    del self._holders[program_id]
                    self._dropped.discard(program_id)

    def _freed(self, program_id: str) -> None:
        # A finalizer, run wherever the program is collected: no lock (the thread
        # may hold it already), and a worker thread cannot be loading this program
        # (a call in flight keeps it alive). Never loaded: nothing to tell anyone.
        if program_id in self._holders:
            self._dropped.add(program_id)

    def call(self, fn, args, kwargs) -> Call:
        """Traces ``fn`` for these arguments (once per signature); the ``Call`` to send."""
        leaves, treedef = jax.tree_util.tree_flatten((args, kwargs or {}), is_leaf=_is_special)
        signature, dynamic, per_worker, iterators = [], [], [], []
        for i, leaf in enumerate(leaves):
            if isinstance(leaf, RemoteValue):
                raise ValueError(
                    "A `RemoteValue` cannot be an argument of a scheduled function: its value "
                    "is not known yet. Call `.fetch()` on it first, or pass what it depends on. "
                    f"Received: argument {i} of the function, {leaf!r}"
                )
            if isinstance(leaf, PerWorkerIterator):
                iterators.append((i, leaf))
                signature.append(("iterator", leaf.dataset.dataset_id))
            elif isinstance(leaf, PerWorkerValues):
                first = np.asarray(leaf.values[0])
                per_worker.append((i, leaf))
                signature.append(("per_worker", first.shape, first.dtype.name))
            elif isinstance(leaf, (jax.Array, np.ndarray, np.generic)):
                array = np.asarray(leaf)
                dynamic.append((i, array))
                signature.append(("array", array.shape, array.dtype.name))
            else:
                signature.append(("static", static_key(leaf)))
        program, used = self._program_for(
            fn, leaves, treedef, signature, dynamic, per_worker, iterators
        )
        # Positions in the program's argument list, in leaf order.
        order = sorted([i for i, _ in dynamic] + [i for i, _ in per_worker])
        rank = {leaf_index: n for n, leaf_index in enumerate(order)}
        return Call(
            program,
            [(rank[i], a) for i, a in dynamic],
            [(rank[i], v) for i, v in per_worker],
            [(it, count) for (_, it), count in zip(iterators, program.iterator_counts)],
            self._strategy.extended.consistency_epoch,
            keep=used,
        )

    def _program_for(self, fn, leaves, treedef, signature, dynamic, per_worker, iterators):
        """The program for these arguments and the variables it uses, traced once per
        signature and variable set."""
        built = set()
        while True:
            variables = self._strategy.extended.live_variables()
            # The function by its code and captures (held weakly): a closure made
            # afresh for every schedule is traced once, as with tf.function.
            key = (key_of(fn), treedef, tuple(signature), tuple(id(v) for v in variables))
            with self._lock:
                program = self._programs.get(key)
                used = program.used_variables() if program is not None else None
                if used is not None:
                    return program, used
                try:
                    program = self._trace(fn, leaves, treedef, dynamic, per_worker, iterators)
                except _UnbuiltOptimizer as stop:
                    unbuilt = stop
                else:
                    self._programs = {k: p for k, p in self._programs.items() if k[0].alive}
                    self._programs[key] = program
                    return program, program.used_variables()
            if id(unbuilt.optimizer) in built:  # (its build did not take: never loop)
                raise RuntimeError(
                    "An optimizer stayed unbuilt after `optimizer.build(...)`. Build it "
                    "inside `strategy.scope()` before scheduling. Received: "
                    f"{unbuilt.optimizer!r}"
                )
            built.add(id(unbuilt.optimizer))
            # As TF makes an optimizer's slots on its first apply, on the ps tasks
            # beside their variables: built here, outside the trace, then traced anew.
            with self._strategy.scope():
                unbuilt.optimizer.build(unbuilt.variables)

    def _trace(self, fn, leaves, treedef, dynamic, per_worker, iterators) -> Program:
        strategy = self._strategy
        variables = strategy.extended.live_variables()
        arg_specs = {}
        for i, array in dynamic:
            arg_specs[i] = jax.ShapeDtypeStruct(array.shape, array.dtype)
        for i, values in per_worker:
            first = np.asarray(values.values[0])
            arg_specs[i] = jax.ShapeDtypeStruct(first.shape, first.dtype)
        arg_positions = sorted(arg_specs)
        counts = [1] * len(iterators)
        record: dict = {}

        def build(used_variables, counts, route, plan=(), any_batch_size=False):
            element_specs = []
            batch_sizes = _batch_size_symbols(sum(counts)) if any_batch_size else None
            for (_, iterator), count in zip(iterators, counts):
                elem_tree, specs = iterator.dataset.element_spec
                per_element = []  # the leaves' specs of each element the program reads
                for _ in range(count):
                    size = None if batch_sizes is None else batch_sizes.pop(0)
                    per_element.append([_element_struct(*spec, size) for spec in specs])
                element_specs.append((elem_tree, per_element))

            def pure(*flat):
                position = len(used_variables)
                values = list(leaves)
                for i in arg_positions:
                    values[i] = flat[position]
                    position += 1
                traced_iterators = []
                for (i, _), (elem_tree, per_element) in zip(iterators, element_specs):
                    elements = []
                    for structs in per_element:
                        group = flat[position : position + len(structs)]
                        elements.append(jax.tree_util.tree_unflatten(elem_tree, list(group)))
                        position += len(structs)
                    values[i] = TracedIterator(elements)
                    traced_iterators.append(values[i])
                worker_index = flat[position]
                args, kwargs = jax.tree_util.tree_unflatten(treedef, values)
                mapping = {id(v): x for v, x in zip(used_variables, flat)}
                old = dict(mapping)
                # Variables the program does not take stand as zeros: the first
                # trace found nothing reads them, and Keras's steps list them all.
                for v in variables:
                    mapping.setdefault(id(v), jnp.zeros(v.shape, v.dtype))
                trace = ProgramTrace(worker_index)
                scope = RoutingScope(mapping)
                router = GradientRouter(enabled=route, scope=scope)
                router.start()
                with scope, tracing(trace), routing_gradients(router), strategy.scope():
                    with on_unbuilt_apply(_stop_at_unbuilt):
                        out = fn(*args, **kwargs)
                _refuse_unshared_writes(scope, variables)
                out_leaves, out_tree = jax.tree_util.tree_flatten(out)
                writes, payloads = [], []
                for n, v in enumerate(used_variables):
                    if id(v) not in scope.assigned:
                        continue
                    new = jnp.asarray(scope.state_mapping[id(v)]).astype(v.dtype)
                    kind = "add" if id(v) in trace.deltas else trace.kinds.get(id(v), "assign")
                    writes.append((n, kind))
                    payloads.append(new - old[id(v)] if kind == "add" else new)
                for step_index, update in plan:
                    payloads += update.worker_values(router.steps[step_index])
                if route and not plan:
                    # The first trace: the gradients count as used (a gradient
                    # may be a variable's value as it is).
                    payloads += [g for step in router.steps for g in step.grads]
                record.update(
                    out_tree=out_tree,
                    writes=writes,
                    counts=[t.taken for t in traced_iterators],
                    steps=router.steps,
                    conflict=router.conflict,
                )
                return [jnp.asarray(x) for x in out_leaves] + payloads

            specs = [jax.ShapeDtypeStruct(v.shape, v.dtype) for v in used_variables]
            specs += [arg_specs[i] for i in arg_positions]
            for _, per_element in element_specs:
                for structs in per_element:
                    specs += structs
            specs.append(jax.ShapeDtypeStruct((), jnp.int32))
            return pure, specs

        # First trace: which variables are used, how many next() calls, which
        # optimizer updates can run on the ps tasks.
        pure, specs = build(variables, counts, route=True)
        closed = jax.make_jaxpr(pure)(*specs)
        if record["counts"] != counts:
            counts = record["counts"]
            pure, specs = build(variables, counts, route=True)
            closed = jax.make_jaxpr(pure)(*specs)
        plan = []
        for step_index, step in enumerate(record["steps"]):
            updates = None if record["conflict"] else plan_updates(step)
            if updates is None:
                # An update cannot run on the ps: every update runs here.
                plan = []
                pure, specs = build(variables, counts, route=False)
                closed = jax.make_jaxpr(pure)(*specs)
                break
            plan += [(step_index, update) for update in updates]
        used_vars = used_inputs(closed.jaxpr, len(variables))
        needed = {n for n, _ in record["writes"]} | used_vars
        sent = {id(v) for _, update in plan for v in update.sent}
        keep = [v for n, v in enumerate(variables) if n in needed or id(v) in sent]
        try:
            # Any batch size, as TF's traced function takes a batch dimension of None:
            # a dataset's last, smaller batch runs the same program.
            pure, specs = build(keep, counts, route=bool(plan), plan=plan, any_batch_size=True)
            exported = _exported(pure, specs)
        except Exception:  # the function needs its batch size as a number: this one only
            pure, specs = build(keep, counts, route=bool(plan), plan=plan)
            exported = _exported(pure, specs)
        for _, update in plan:
            strategy.extended.parameter_servers.load_update(update)
        self.traces += 1
        program = Program(
            bytes(exported.serialize()),
            keep,
            record["writes"],
            record["out_tree"],
            counts,
            [update for _, update in plan],
        )
        weakref.finalize(program, self._freed, program.program_id).atexit = False
        return program


def _exported(pure, specs):
    """``pure`` exported for the workers; a clear error for what cannot travel."""
    try:
        return jax.export.export(jax.jit(pure), platforms=_platforms())(*specs)
    except NotImplementedError as error:
        if "host_callback" not in str(error):
            raise
        raise NotImplementedError(
            "A scheduled function cannot call back into Python on its worker "
            "(`jax.debug.print`, `jax.debug.callback`, `jax.pure_callback`, "
            "`io_callback`): it travels to the workers as a serialized program, and "
            "JAX cannot serialize host callbacks. Return the values instead and print "
            "them on the coordinator after `fetch()` (TF's `tf.print` printed on the "
            f"worker). Received: {error}"
        ) from None


def _batch_size_symbols(count: int) -> list:
    """One symbolic batch size per element a program reads (``b0``, ``b1``...), one scope."""
    if not count:
        return []
    return list(jax.export.symbolic_shape(", ".join(f"b{n}" for n in range(count))))


def _element_struct(shape, dtype, batch_size=None):
    """An element leaf's spec; with ``batch_size`` (a symbol), its leading dimension is that."""
    if batch_size is None or not len(shape):
        return jax.ShapeDtypeStruct(shape, dtype)
    return jax.ShapeDtypeStruct((batch_size, *shape[1:]), dtype)


def _platforms() -> tuple:
    platform = jax.default_backend()
    return (platform,) if platform == "cpu" else (platform, "cpu")


class _UnbuiltOptimizer(Exception):
    """Stops a trace at an optimizer's first apply: it is built outside, then traced anew."""

    def __init__(self, optimizer, variables):
        super().__init__(optimizer)
        self.optimizer = optimizer
        self.variables = variables


def _stop_at_unbuilt(optimizer, variables):
    raise _UnbuiltOptimizer(optimizer, variables)


def _refuse_unshared_writes(scope, variables) -> None:
    """A scheduled function may write only the strategy's variables (the ps tasks hold them).

    A variable created outside ``strategy.scope()`` (an optimizer made before it:
    its step counter) lives on the coordinator only; a worker's write to it would
    be lost without a word. TF refuses such a variable too.
    """
    shared = {id(v) for v in variables}
    strays = [v for v in scope.assigned.values() if id(v) not in shared and variable_has_value(v)]
    if strays:
        raise ValueError(
            f"Variable {strays[0].path!r} was created outside `strategy.scope()` and is "
            "written by a scheduled function: the workers cannot update it (the ps tasks "
            "hold the strategy's variables), so its updates would be lost. Create it, and "
            "the optimizer whose step counter it may be, inside `with strategy.scope():`. "
            f"Received: {len(strays)} such variables, e.g. {strays[0]!r}"
        )
