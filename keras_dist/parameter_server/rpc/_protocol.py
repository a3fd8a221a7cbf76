"""The parameter-server protocol: every request's op and fields, in one schema.

A request is a JSON header, a list of arrays and an opaque blob (``_wire``).
The header's ``op`` names one of the ``Op``s below; each declares which task
serves it, the header fields it needs (with their JSON types), what its arrays
and blob hold. Callers build headers with ``request`` (naming the op from the
schema) and the serving task checks each one with ``check_request`` before
acting, so a malformed request is refused whole, with what was received,
instead of failing halfway through.

======================  ======  ==================================================
op                      served  what it does
======================  ======  ==================================================
``ping``                any     answers with the task's name (liveness)
``create``              ps      stores one value per key (``if_absent``: keeps one)
``read``                ps      the values of ``keys``, one consistent snapshot
``update``              ps      ``writes`` (assign/add/sub), optimizer ``updates``,
                                then the values of ``read``, all under one lock;
                                once per ``run_id`` (a call run again, or a
                                request sent again after a lost connection, is
                                not applied again)
``delete``              ps      forgets ``keys`` (a variable was freed)
``load_update``         ps      keeps an optimizer update's program (the blob)
``load``                worker  keeps a scheduled function's program (the blob)
``run``                 worker  runs a loaded program on the arrays
``run_many``            worker  several ``run`` calls in one request, in order
``dataset``             worker  builds a per-worker dataset (the blob: its function)
``iterator``            worker  starts an iterator over a built dataset
``stop``                any     stops the task's server once it has answered (the
                                chief's program ended: the job is over)
======================  ======  ==================================================

>>> request(READ, keys=["v/0"])
{'op': 'read', 'keys': ['v/0']}
>>> check_request({"op": "read", "keys": "v/0"}, "ps")
Traceback (most recent call last):
...
keras_dist.errors.InvalidArgumentError: The `read` request's field `keys` must be a list. \
Received: keys='v/0'
"""

from typing import NamedTuple

from keras_dist import errors

WRITE_KINDS = ("assign", "add", "sub")


class Op(NamedTuple):
    """One kind of request: who serves it and the header fields it carries."""

    name: str
    server: str  # "ps", "worker" or "any"
    fields: tuple = ()  # (name, JSON type) every request has
    optional: tuple = ()  # (name, JSON type) a request may have
    arrays: str = "none"
    blob: str = "empty"


_ID = str
PING = Op("ping", "any")
STOP = Op("stop", "any")
CREATE = Op("create", "ps", (("keys", list),), (("if_absent", bool),), arrays="one value per key")
READ = Op("read", "ps", (("keys", list),))
UPDATE = Op(
    "update",
    "ps",
    (("writes", list),),
    # ``run_id``: the scheduled call whose step this is (or the request's own id);
    # a ps applies each once.
    (("read", list), ("updates", list), ("run_id", _ID)),
    arrays="one per write, then each optimizer update's arrays",
)
DELETE = Op("delete", "ps", (("keys", list),))
LOAD_UPDATE = Op(
    "load_update",
    "ps",
    (("update_id", _ID), ("held", list), ("written", list)),
    blob="the update's serialized jax.export program",
)
LOAD = Op(
    "load",
    "worker",
    (
        ("program_id", _ID),
        ("variables", list),
        ("writes", list),
        ("n_results", int),
        ("updates", list),
    ),
    blob="the function's serialized jax.export program",
)
RUN = Op(
    "run",
    "worker",
    (("program_id", _ID), ("worker_index", int), ("iterators", list)),
    # ``run_id`` stays the same when a lost worker's call runs again elsewhere.
    # ``fresh``: [[ps task, version]], the newest versions of the ps tasks that
    # the coordinator has seen a finished call leave (``PsVersions``).
    (("epoch", (int, type(None))), ("n_arrays", int), ("run_id", _ID), ("fresh", list)),
    arrays="the program's inputs",
)
RUN_MANY = Op(
    "run_many",
    "worker",
    (("calls", list),),
    (("unload", list),),  # programs the coordinator freed: dropped before the calls run
    arrays="each call's inputs, in order",
)
DATASET = Op(
    "dataset",
    "worker",
    (("dataset_id", _ID), ("worker_index", int)),
    blob="the cloudpickled dataset function",
)
ITERATOR = Op("iterator", "worker", (("dataset_id", _ID), ("iterator_id", _ID)))

OPS = {
    op.name: op
    for op in (PING, CREATE, READ, UPDATE, DELETE, LOAD_UPDATE, LOAD, RUN, RUN_MANY)
    + (DATASET, ITERATOR, STOP)
}


def request(op: Op, **fields) -> dict:
    """The header of an ``op`` request with ``fields`` (the serving task checks it)."""
    return {"op": op.name, **fields}


def check_request(header: dict, server: str) -> Op:
    """The ``Op`` of ``header`` after checking it against the schema, for a ``server`` task.

    Raises ``InvalidArgumentError`` naming what is wrong and what was received:
    an unknown op, one another kind of task serves, a missing field or one of
    the wrong type (also inside ``run_many``'s calls and ``update``'s writes).
    """
    name = header.get("op")
    op = OPS.get(name) if isinstance(name, str) else None
    if op is None:
        raise errors.InvalidArgumentError(
            f"Unknown request `{name}`: the caller runs another version of keras_dist, or "
            f"is not keras_dist. Known: {sorted(OPS)}. Received: op={name!r}"
        )
    if op.server not in ("any", server):
        raise errors.InvalidArgumentError(
            f"A {server} task does not serve `{name}` requests (a {op.server} task does): "
            f"check the address the caller was given. Received: op={name!r}"
        )
    _check_fields(op, header)
    if op is RUN_MANY:
        for call in header["calls"]:
            if not isinstance(call, dict):
                raise errors.InvalidArgumentError(
                    f"Each call of a `run_many` request must be a header. Received: {call!r}"
                )
            _check_fields(RUN, call)
    if op is UPDATE:
        _check_update(header)
    return op


def _check_fields(op: Op, header: dict) -> None:
    for field, kind in op.fields + op.optional:
        if field not in header:
            if (field, kind) in op.fields:
                raise errors.InvalidArgumentError(
                    f"The `{op.name}` request lacks its field `{field}`. Received: fields="
                    f"{sorted(header)}"
                )
            continue
        value = header[field]
        # JSON has no separate booleans for integers: True is not a count.
        wrong_bool = isinstance(value, bool) and kind is int
        if wrong_bool or not isinstance(value, kind):
            expected = (
                kind.__name__ if isinstance(kind, type) else "/".join(k.__name__ for k in kind)
            )
            raise errors.InvalidArgumentError(
                f"The `{op.name}` request's field `{field}` must be a {expected}. "
                f"Received: {field}={value!r}"
            )


def _check_update(header: dict) -> None:
    for write in header["writes"]:
        valid = (
            isinstance(write, list)
            and len(write) == 2
            and isinstance(write[0], str)
            and write[1] in WRITE_KINDS
        )
        if not valid:
            raise errors.InvalidArgumentError(
                "Each write of an `update` request is [key, kind] with kind one of "
                f"{list(WRITE_KINDS)}. Received: {write!r}"
            )
    for update in header.get("updates", ()):
        valid = (
            isinstance(update, list)
            and len(update) == 2
            and isinstance(update[0], str)
            and isinstance(update[1], int)
        )
        if not valid:
            raise errors.InvalidArgumentError(
                "Each optimizer update of an `update` request is [update_id, array count]. "
                f"Received: {update!r}"
            )
