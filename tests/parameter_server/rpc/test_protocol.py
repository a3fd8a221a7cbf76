"""The parameter-server protocol (``parameter_server/rpc/_protocol.py``): one schema, checked.

Every request the package sends is built from the schema, and every task checks a
request against it before acting: a malformed one is refused whole, naming what was
received.
"""

import ast
import pathlib

import numpy as np
import pytest

import keras_dist as kd
from keras_dist.parameter_server.rpc import _protocol as protocol
from keras_dist.parameter_server.rpc import _wire
from keras_dist.parameter_server.tasks._store import VariableStore

PACKAGE = pathlib.Path(kd.__file__).parent

SAMPLES = {
    "ping": {},
    "create": {"keys": ["v"], "if_absent": True},
    "read": {"keys": ["v"]},
    "update": {"writes": [["v", "add"]], "read": ["v"], "updates": [["u1", 2]]},
    "delete": {"keys": ["v"]},
    "load_update": {"update_id": "u1", "held": ["v"], "written": [0]},
    "load": {"program_id": "p1", "variables": [], "writes": [], "n_results": 1, "updates": []},
    "run": {"program_id": "p1", "worker_index": 0, "iterators": [], "epoch": None},
    "run_many": {"calls": [{"program_id": "p1", "worker_index": 1, "iterators": []}]},
    "dataset": {"dataset_id": "d1", "worker_index": 0},
    "iterator": {"dataset_id": "d1", "iterator_id": "i1"},
    "stop": {},
}


def test_the_schema_has_the_twelve_ops():
    assert sorted(protocol.OPS) == sorted(SAMPLES)


@pytest.mark.parametrize("name", sorted(SAMPLES))
def test_a_well_formed_request_passes_where_it_is_served(name):
    op = protocol.OPS[name]
    header = protocol.request(op, **SAMPLES[name])
    assert header["op"] == name
    servers = ("ps", "worker") if op.server == "any" else (op.server,)
    for server in servers:
        assert protocol.check_request(header, server) is op


BAD = {
    "an unknown op": ({"op": "bogus"}, "ps", r"Unknown request `bogus`.*Received: op='bogus'"),
    "no op": ({"keys": []}, "ps", r"Unknown request `None`"),
    "a worker's op sent to a ps": (
        {"op": "run", "program_id": "p", "worker_index": 0, "iterators": []},
        "ps",
        r"A ps task does not serve `run` requests",
    ),
    "a missing field": ({"op": "read"}, "ps", r"`read` request lacks its field `keys`"),
    "a field of the wrong type": (
        {"op": "read", "keys": "v"},
        "ps",
        r"field `keys` must be a list\. Received: keys='v'",
    ),
    "a boolean for a count": (
        {"op": "dataset", "dataset_id": "d", "worker_index": True},
        "worker",
        r"field `worker_index` must be a int",
    ),
    "a write of an unknown kind": (
        {"op": "update", "writes": [["v", "asign"]]},
        "ps",
        r"kind one of \['assign', 'add', 'sub'\]\. Received: \['v', 'asign'\]",
    ),
    "a malformed optimizer update": (
        {"op": "update", "writes": [], "updates": [["u", "2"]]},
        "ps",
        r"\[update_id, array count\]\. Received: \['u', '2'\]",
    ),
    "a run_many call without its program": (
        {"op": "run_many", "calls": [{"worker_index": 0, "iterators": []}]},
        "worker",
        r"`run` request lacks its field `program_id`",
    ),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_a_malformed_request_is_refused_with_what_was_received(case):
    header, server, message = BAD[case]
    with pytest.raises(kd.errors.InvalidArgumentError, match=message):
        protocol.check_request(header, server)


def test_the_store_applies_nothing_of_a_request_with_a_bad_write_kind():
    store = VariableStore("/job:ps/task:0")
    store.handle({"op": "create", "keys": ["a", "b"]}, [np.zeros(2), np.zeros(2)], b"")
    header = {"op": "update", "writes": [["a", "add"], ["b", "substract"]]}
    with pytest.raises(kd.errors.InvalidArgumentError, match="substract"):
        store.handle(header, [np.ones(2), np.ones(2)], b"")
    _, values, _ = _wire.decode(store.handle({"op": "read", "keys": ["a", "b"]}, [], b""))
    np.testing.assert_array_equal(values[0], [0.0, 0.0])  # the valid first write was not applied
    np.testing.assert_array_equal(values[1], [0.0, 0.0])


def _op_literals(path: pathlib.Path) -> list:
    """Dict literals with an ``"op"`` key: requests written by hand, outside the schema."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Dict) and any(
            isinstance(key, ast.Constant) and key.value == "op" for key in node.keys
        ):
            found.append(f"{path.relative_to(PACKAGE.parent)}:{node.lineno}")
    return found


def test_every_request_is_built_from_the_schema():
    modules = [p for p in PACKAGE.rglob("*.py") if p.name != "_protocol.py"]
    assert [hit for path in modules for hit in _op_literals(path)] == []


def _string_dispatch(path: pathlib.Path, relative_to: pathlib.Path = PACKAGE.parent) -> list:
    """Comparisons with an op's name (``op == "run"``): dispatch outside the schema's ``Op``."""
    names = set(protocol.OPS)
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Compare) and any(
            isinstance(side, ast.Constant) and side.value in names
            for side in [node.left, *node.comparators]
        ):
            found.append(f"{path.relative_to(relative_to)}:{node.lineno}")
    return found


def test_servers_dispatch_on_the_schemas_ops_not_on_strings(tmp_path):
    wing = PACKAGE / "parameter_server"
    modules = [p for p in wing.rglob("*.py") if p.name != "_protocol.py"]
    assert [hit for path in modules for hit in _string_dispatch(path)] == []
    planted = tmp_path / "planted.py"
    planted.write_text('def handle(op):\n    if op == "read":\n        return 1\n')
    assert _string_dispatch(planted, relative_to=tmp_path) == ["planted.py:2"]


@pytest.mark.parametrize(
    "second, message",
    [
        (np.array(["x", "y"]), "dtype the variable cannot take"),
        (np.ones(3), "wrong shape"),
        (np.ones(2, np.complex64), "dtype the variable cannot take"),
    ],
    ids=["a string", "a shape", "complex into float"],
)
def test_a_request_whose_second_write_cannot_be_applied_changes_nothing(second, message):
    store = VariableStore("/job:ps/task:0")
    store.handle({"op": "create", "keys": ["a", "b"]}, [np.zeros(2), np.zeros(2)], b"")
    before = store.version
    header = {"op": "update", "writes": [["a", "add"], ["b", "assign"]]}
    with pytest.raises(kd.errors.InvalidArgumentError, match=message):
        store.handle(header, [np.ones(2), second], b"")
    _, values, _ = _wire.decode(store.handle({"op": "read", "keys": ["a", "b"]}, [], b""))
    np.testing.assert_array_equal(values[0], [0.0, 0.0])
    np.testing.assert_array_equal(values[1], [0.0, 0.0])
    assert store.version == before


def test_an_update_with_arrays_missing_is_refused_whole():
    store = VariableStore("/job:ps/task:0")
    store.handle({"op": "create", "keys": ["a", "b"]}, [np.zeros(2), np.zeros(2)], b"")
    header = {"op": "update", "writes": [["a", "add"], ["b", "add"]]}
    with pytest.raises(kd.errors.InvalidArgumentError, match="carries 1 arrays for 2 writes"):
        store.handle(header, [np.ones(2)], b"")
    _, values, _ = _wire.decode(store.handle({"op": "read", "keys": ["a"]}, [], b""))
    np.testing.assert_array_equal(values[0], [0.0, 0.0])


def test_a_float64_write_to_a_float32_variable_is_taken():
    store = VariableStore("/job:ps/task:0")
    store.handle({"op": "create", "keys": ["a"]}, [np.zeros(2, np.float32)], b"")
    store.handle({"op": "update", "writes": [["a", "add"]]}, [np.ones(2, np.float64)], b"")
    _, values, _ = _wire.decode(store.handle({"op": "read", "keys": ["a"]}, [], b""))
    assert values[0].dtype == np.float32 and values[0].tolist() == [1.0, 1.0]
