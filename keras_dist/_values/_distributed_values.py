"""Values that have one component per replica: ``PerReplica`` and ``Mirrored``.

A distributed value is held in one of four forms, whichever is at hand:

* ``components``: one array per local replica, each on its replica's device
  (the eager engine's form, and the only one possible when shapes differ);
* a *stacked* global ``jax.Array`` of shape ``(num_replicas, *shape)`` split
  over the strategy's mesh along ``"replica"`` (what the compiled engine and the
  input pipeline produce: one buffer per device, no copies);
* a *joined* global ``jax.Array`` of shape ``(num_replicas * rows, ...)``,
  each replica's component one shard of it (large outputs of a compiled step on
  CPU: a shard *is* its component, no copy; ``stacked`` is made when asked);
* a *traced* local value inside a compiled ``merge_call``: the calling
  replica's tracer, whose other components are reached through collectives.

Both ``PerReplica`` and ``Mirrored`` are JAX pytrees whose children are the
per-replica components.
"""

import copy
import operator

import jax
import keras
import numpy as np

from keras_dist._keras import same_variable


class DistributedValues:
    """Base class for a value with one component per replica.

    Read the components with ``strategy.experimental_local_results(value)``.

    >>> import keras_dist as kd
    >>> v = kd.PerReplica((1.0, 2.0))
    >>> v.values
    (1.0, 2.0)
    """

    def __init__(
        self,
        values,
        *,
        _stacked=None,
        _joined=None,
        _replicated=None,
        _traced=None,
        _validate=True,
    ):
        if values is not None:
            values = tuple(values)
            if _validate:
                for component in values:
                    _check_component(component)
        self._components = values
        self._stacked = _stacked  # PerReplica: (num_replicas, ...) split on the mesh
        self._joined = _joined  # PerReplica: (num_replicas * rows, ...) split on the mesh
        self._replicated = _replicated  # Mirrored: one value replicated on the mesh
        self._traced = _traced  # a `_TracedValue` inside a compiled merge_call
        self._sum = None  # the replicas' sum, when the compiled step computed it
        # Across processes: the replicas' shapes differ somewhere, maybe not here.
        self._uneven_across_processes = False

    @property
    def values(self) -> tuple:
        """The local components, one per local replica, in replica order."""
        if self._components is None:
            if self._traced is not None:
                self._components = self._traced.all_components()
            elif self._replicated is not None:
                self._components = replicated_components(self._replicated)
            elif self._joined is not None:
                self._components = shard_components(self._joined)
            else:
                self._components = unstack_result(self._stacked)
        return self._components

    # The storage forms, read by the engines and the input pipeline.
    @property
    def stacked(self):
        """The components as one ``(num_replicas, ...)`` array split on the mesh, or ``None``."""
        if self._stacked is None and self._joined is not None:
            self._stacked = stack_shards(self._joined)
        return self._stacked

    def cache_stacked(self, stacked) -> None:
        """Keeps ``stacked``, made from this value's immutable components, for the next use."""
        self._stacked = stacked

    @property
    def replicated(self):
        """A ``Mirrored`` value's one array replicated on the mesh, or ``None``."""
        return self._replicated

    @property
    def traced(self):
        """Inside a compiled ``merge_call``: the calling replica's traced component, or ``None``."""
        return self._traced

    @property
    def components(self):
        """The local components when held one per device, else ``None`` (see ``values``)."""
        return self._components

    @property
    def replica_sum(self):
        """The replicas' sum, when the compiled step computed it; else ``None``."""
        return self._sum

    @replica_sum.setter
    def replica_sum(self, value):
        self._sum = value

    @property
    def uneven_across_processes(self) -> bool:
        """Across processes: whether the replicas' shapes differ somewhere, maybe not here."""
        return self._uneven_across_processes

    @uneven_across_processes.setter
    def uneven_across_processes(self, value: bool):
        self._uneven_across_processes = value

    @property
    def _primary(self):
        return self.values[0]

    def local(self):
        """The calling replica's component inside a compiled ``merge_call``."""
        return self._traced.local

    def __len__(self):
        return len(self.values)

    def __repr__(self):
        if self._traced is not None:
            return f"{type(self).__name__}(<traced: {self._traced.local!r}>)"
        body = ", ".join(f"{i}: {v!r}" for i, v in enumerate(self.values))
        return f"{type(self).__name__}:{{{body}}}"


class PerReplica(DistributedValues):
    """Holds a (possibly different) value for each replica.

    ``strategy.run`` returns ``PerReplica`` values, and a distributed dataset
    yields them. Reduce them with ``strategy.reduce`` or read the components
    with ``strategy.experimental_local_results``.

    >>> import keras_dist as kd
    >>> import jax
    >>> jax.tree_util.tree_map(lambda x: x + 10, kd.PerReplica((1.0, 2.0))).values
    (11.0, 12.0)
    """


class DistributedDelegate(DistributedValues):
    """A distributed value that acts as its first component in Python operators.

    >>> d = DistributedDelegate((7, 8))
    >>> d + 1, d / 2, 15 // d
    (8, 3.5, 2)
    """

    def __getattr__(self, name):
        # Private names are ours; never delegate them (copy() probes them too).
        if name.startswith("_"):
            raise AttributeError(name)
        return getattr(self._primary, name)

    def __copy__(self):
        return type(self)(copy.copy(self.values), _validate=False)

    def __deepcopy__(self, memo):
        return type(self)(copy.deepcopy(self.values, memo), _validate=False)

    def __array__(self, dtype=None, copy=None):
        return np.asarray(self._primary, dtype=dtype)

    def __jax_array__(self):
        return jax.numpy.asarray(self._primary)

    def __bool__(self):
        return bool(self._primary)

    def __int__(self):
        return int(self._primary)

    def __float__(self):
        return float(self._primary)

    def __index__(self):
        return operator.index(self._primary)

    def __hash__(self):
        return id(self)


def _delegate(op, reflected=False):
    def method(self, *others):
        if reflected:
            return op(others[0], self._primary)
        return op(self._primary, *(_unwrap(o) for o in others))

    return method


def _unwrap(value):
    return value.values[0] if isinstance(value, DistributedDelegate) else value


_BINARY = {
    "add": operator.add, "sub": operator.sub, "mul": operator.mul,
    "truediv": operator.truediv, "floordiv": operator.floordiv,
    "mod": operator.mod, "pow": pow, "matmul": operator.matmul,
    "and": operator.and_, "or": operator.or_, "xor": operator.xor,
    "lshift": operator.lshift, "rshift": operator.rshift,
}  # fmt: skip
for _name, _op in _BINARY.items():
    setattr(DistributedDelegate, f"__{_name}__", _delegate(_op))
    setattr(DistributedDelegate, f"__r{_name}__", _delegate(_op, reflected=True))
for _name, _op in {
    "lt": operator.lt, "le": operator.le, "gt": operator.gt, "ge": operator.ge,
    "eq": operator.eq, "ne": operator.ne, "neg": operator.neg,
    "pos": operator.pos, "abs": abs, "invert": operator.invert,
}.items():  # fmt: skip
    setattr(DistributedDelegate, f"__{_name}__", _delegate(_op))
DistributedDelegate.__divmod__ = _delegate(divmod)
DistributedDelegate.__rdivmod__ = _delegate(divmod, reflected=True)


class Mirrored(DistributedDelegate):
    """Holds the same value on every replica; acts as that value in operators.

    >>> import keras_dist as kd
    >>> m = kd.Mirrored((3.0, 3.0))
    >>> m + m, m + 1
    (6.0, 4.0)
    """


def _flatten(value):
    return value.values, None


def _register(cls):
    jax.tree_util.register_pytree_node(
        cls, _flatten, lambda _, children: cls(children, _validate=False)
    )


for _cls in (PerReplica, Mirrored):
    _register(_cls)


def _check_component(component):
    for leaf in jax.tree_util.tree_leaves(component):
        if not isinstance(leaf, (jax.Array, np.ndarray, np.generic, int, float, bool, complex)):
            if not hasattr(leaf, "__jax_array__") and not hasattr(leaf, "__array__"):
                raise TypeError(
                    f"Could not build a TypeSpec for {component!r}: every component of "
                    "a distributed value must be an array or a nest of arrays. "
                    f"Received: {type(leaf).__name__} {leaf!r}"
                )


def unstack(stacked: jax.Array) -> tuple:
    """The local components of a stacked ``(num_replicas, ...)`` global array."""
    if isinstance(stacked, np.ndarray):
        return tuple(stacked)  # a host batch not yet placed
    if isinstance(stacked, jax.core.Tracer):
        return tuple(stacked[i] for i in range(stacked.shape[0]))  # inside a kd.function
    return tuple(_first_row(shard.data) for shard in _replica_shards(stacked))


def _replica_shards(array: jax.Array) -> list:
    """One shard per local replica of an array split along ``"replica"``, in replica order.

    A replica spanning several cores holds a copy on each: one per replica is kept.
    """
    shards = [s for s in array.addressable_shards if s.replica_id == 0]
    shards.sort(key=lambda s: s.index[0].start or 0)
    return shards


# One cached program: 7 µs a call, where `shard.data[0]` op by op costs 75 µs.
_first_row = jax.jit(lambda row: row[0])

# From this size a CPU component is not copied to be read: a ready stacked result's
# components are views, and a compiled step's outputs leave the program joined.
LARGE_COMPONENT_BYTES = 1 << 20


def unstack_result(stacked) -> tuple:
    """``unstack`` for a result read by the user: large CPU ones without copying, when ready.

    Dropping the leading axis of a shard is a copy in XLA (51 ms for 64 MiB on
    this CPU). A ready CPU shard is host memory: the component is a view of it.
    Not for variables' storage: a viewed buffer is no longer donated to a step.
    """
    if not isinstance(stacked, jax.Array) or isinstance(stacked, jax.core.Tracer):
        return unstack(stacked)
    shards = _replica_shards(stacked)
    if (
        not shards
        or shards[0].device.platform != "cpu"
        or shards[0].data.nbytes < LARGE_COMPONENT_BYTES
        or jax.dtypes.issubdtype(stacked.dtype, jax.dtypes.extended)  # PRNG keys: no NumPy form
        or not stacked.is_ready()
    ):
        return unstack(stacked)
    return tuple(
        jax.device_put(np.asarray(shard.data)[0], shard.device, may_alias=True) for shard in shards
    )


def shard_components(joined: jax.Array) -> tuple:
    """The local components of a joined ``(num_replicas * rows, ...)`` array: its shards."""
    return tuple(shard.data for shard in _replica_shards(joined))


def stack_shards(joined: jax.Array) -> jax.Array:
    """A joined array as the stacked ``(num_replicas, rows, ...)`` one (a copy per device)."""
    rows = joined.sharding.shard_shape(joined.shape)[0]
    arrays = [_add_replica_axis(shard.data) for shard in joined.addressable_shards]
    shape = (joined.shape[0] // rows, rows) + joined.shape[1:]
    return jax.make_array_from_single_device_arrays(shape, joined.sharding, arrays)


_add_replica_axis = jax.jit(lambda rows: rows[None])


def replicated_components(array: jax.Array) -> tuple:
    """The per-replica copies of a replicated global array, in mesh order.

    A replica's copy is the one on its first core (the first device of its
    row of the ``(replica, logical)`` mesh).
    """
    by_device = {shard.device: shard.data for shard in array.addressable_shards}
    devices = array.sharding.mesh.devices
    firsts = devices.reshape(devices.shape[0], -1)[:, 0]
    return tuple(by_device[d] for d in firsts if d in by_device)


def select_replica(replica_id: int, structure):
    """The nest ``structure`` with each distributed value replaced by one component."""
    return jax.tree_util.tree_map(
        lambda x: x.values[replica_id] if isinstance(x, DistributedValues) else x,
        structure,
        is_leaf=lambda x: isinstance(x, DistributedValues),
    )


def regroup(per_replica_structures: list, wrap=PerReplica, always_wrap=False, keep_same=None):
    """Turns one nest per replica into one nest of ``PerReplica`` values.

    Leaves that are the same object on every replica stay plain values, as in
    TF (``keep_same(leaf)``, when given, says which of them may). Structures
    that differ between replicas raise ``AssertionError``.
    """
    first = per_replica_structures[0]
    leaves0, treedef = jax.tree_util.tree_flatten(first, is_leaf=_is_leaf)
    all_leaves = [leaves0]
    for other in per_replica_structures[1:]:
        leaves, other_def = jax.tree_util.tree_flatten(other, is_leaf=_is_leaf)
        if other_def != treedef:
            raise AssertionError(
                "The replicas returned values of different structures; every replica "
                f"must return the same nest. Received: {treedef} and {other_def}"
            )
        all_leaves.append(leaves)
    grouped = []
    for column in zip(*all_leaves):
        same = not always_wrap and all(_same(c, column[0]) for c in column)
        if same and (keep_same is None or keep_same(column[0])):
            grouped.append(column[0])
        else:
            grouped.append(wrap(column, _validate=False))
    return jax.tree_util.tree_unflatten(treedef, grouped)


def _same(a, b) -> bool:
    """The same object, or two handles of one variable (``_keras.same_variable``)."""
    return a is b or (_is_keras_variable(a) and _is_keras_variable(b) and same_variable(a, b))


def _is_leaf(x):
    return x is None or isinstance(x, DistributedValues) or _is_keras_variable(x)


def _is_keras_variable(x):
    return isinstance(x, keras.Variable)
