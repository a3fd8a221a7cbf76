"""The porting table (docs/porting.md) covers every tf.distribute name and claims only what exists.

TF's names come from tests/data/tf_distribute_names.json, written from TF 2.21 by
tests/data/list_tf_distribute_names.py, so this test runs without TensorFlow.
"""

import json
import re
from pathlib import Path

import keras_dist

ROOT = Path(__file__).resolve().parents[2]
PAGE = ROOT / "docs" / "porting.md"
TF_NAMES = ROOT / "tests" / "data" / "tf_distribute_names.json"
STATUSES = ("same", "different", "not provided")
_CODE = re.compile(r"^`([A-Za-z_][\w.]*)`$")
_LINK = re.compile(r"\[[^\]]+\]\([^)]+\)")


def tf_names() -> list[str]:
    data = json.loads(TF_NAMES.read_text())
    return [f"{namespace}.{name}" for namespace, names in data["names"].items() for name in names]


def parse_table(text: str) -> list[dict]:
    """The rows whose first cell is a `tf.distribute...` name, as dicts of their four cells."""
    rows = []
    for line in text.splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if not line.startswith("| `tf.distribute.") or len(cells) != 4:
            continue
        tf_cell, kd_cell, status, notes = cells
        rows.append(
            {
                "tf": _CODE.match(tf_cell).group(1),
                "kd": _CODE.match(kd_cell).group(1) if kd_cell else None,
                "kd_cell": kd_cell,
                "status": status,
                "notes": notes,
            }
        )
    return rows


def resolve(name: str):
    """``kd.a.b`` looked up attribute by attribute from the keras_dist package."""
    parts = name.split(".")
    assert parts[0] == "kd", name
    obj = keras_dist
    for part in parts[1:]:
        obj = getattr(obj, part)
    return obj


def exists(name: str) -> bool:
    try:
        resolve(name)
    except AttributeError:
        return False
    return True


def problems(rows: list[dict], names: list[str]) -> list[str]:
    """Everything wrong with a table: an empty list when it is right."""
    found = []
    listed = [row["tf"] for row in rows]
    for name in names:
        if listed.count(name) != 1:
            found.append(f"{name} appears {listed.count(name)} times in the table")
    for name in sorted(set(listed) - set(names)):
        found.append(f"{name} is not a public name of TF's tf.distribute")
    for row in rows:
        where = row["tf"]
        if row["status"] not in STATUSES:
            found.append(f"{where}: status {row['status']!r} is not one of {STATUSES}")
            continue
        if row["kd_cell"] and row["kd"] is None:
            found.append(f"{where}: the keras_dist cell {row['kd_cell']!r} is not one `name`")
            continue
        if row["status"] == "same":
            expected = "kd." + where.removeprefix("tf.distribute.")
            if row["kd"] != expected:
                found.append(f"{where}: a 'same' row must name {expected}, not {row['kd']}")
            elif not exists(row["kd"]):
                found.append(f"{where}: {row['kd']} does not exist in keras_dist")
        elif row["status"] == "different":
            if row["kd"] is None or not exists(row["kd"]):
                found.append(f"{where}: a 'different' row must name what keras_dist has")
            if not _LINK.search(row["notes"]):
                found.append(f"{where}: a 'different' row must link to the explanation")
        else:
            if row["kd"] is not None:
                found.append(f"{where}: a 'not provided' row names {row['kd']}")
            counterpart = "kd." + where.removeprefix("tf.distribute.")
            if exists(counterpart):
                found.append(f"{where}: marked 'not provided', but {counterpart} exists")
            if not row["notes"]:
                found.append(f"{where}: a 'not provided' row must say why")
    return found


def test_tf_name_list_is_tf_2_21s():
    data = json.loads(TF_NAMES.read_text())
    assert data["tensorflow"] == "2.21.0"
    names = tf_names()
    assert len(names) == len(set(names)) == 60
    assert "tf.distribute.MirroredStrategy" in names
    assert "tf.distribute.cluster_resolver.TFConfigClusterResolver" in names


def test_porting_table_covers_every_tf_name_and_claims_only_what_exists():
    rows = parse_table(PAGE.read_text())
    assert problems(rows, tf_names()) == []


def test_most_names_are_the_same():
    statuses = [row["status"] for row in parse_table(PAGE.read_text())]
    assert statuses.count("same") >= 45, statuses


def test_the_check_catches_a_missing_row_and_a_false_claim():
    text = PAGE.read_text()
    rows = parse_table(text)
    names = tf_names()
    without_one = [row for row in rows if row["tf"] != "tf.distribute.get_strategy"]
    assert problems(without_one, names) == [
        "tf.distribute.get_strategy appears 0 times in the table"
    ]

    lying = [dict(row) for row in rows]
    for row in lying:
        if row["tf"] == "tf.distribute.experimental.PreemptionWatcher":
            row.update(kd="kd.experimental.PreemptionWatcher", status="same")
    assert problems(lying, names) == [
        "tf.distribute.experimental.PreemptionWatcher: "
        "kd.experimental.PreemptionWatcher does not exist in keras_dist"
    ]

    unexplained = [dict(row) for row in rows]
    for row in unexplained:
        if row["tf"] == "tf.distribute.TPUStrategy":
            row["notes"] = "runs on the TPU VM"
    assert problems(unexplained, names) == [
        "tf.distribute.TPUStrategy: a 'different' row must link to the explanation"
    ]

    understated = [dict(row) for row in rows]
    for row in understated:
        if row["tf"] == "tf.distribute.Server":
            row.update(kd=None, kd_cell="", status="not provided")
    assert problems(understated, names) == [
        "tf.distribute.Server: marked 'not provided', but kd.Server exists"
    ]
