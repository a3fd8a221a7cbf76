"""Every private Keras symbol keras_dist touches is checked when keras_dist is imported.

The list lives in `keras_dist/_keras/_internals.py`. A Keras release that removes or
changes one of them must make `import keras_dist` fail with a message that names the
symbol and the supported Keras versions, not crash later inside `fit`.
"""

import pathlib
import subprocess
import sys
import textwrap

import pytest
import tomllib

from keras_dist._keras import _internals


@pytest.mark.parametrize("symbol", _internals.SYMBOLS, ids=lambda s: s.qualname)
def test_symbol_is_present_with_its_parameters(symbol):
    _internals.check_symbol(symbol)


@pytest.mark.parametrize(
    "owner,method,name", _internals.ATTRIBUTES, ids=lambda x: getattr(x, "__name__", str(x))
)
def test_instance_attribute_is_still_set(owner, method, name):
    _internals.check_attribute(owner, method, name)


def test_the_list_covers_every_internal_the_issue_names():
    names = {symbol.name for symbol in _internals.SYMBOLS}
    expected = {
        "fit", "evaluate", "predict", "train_on_batch", "test_on_batch", "predict_on_batch",
        "make_train_function", "make_test_function", "make_predict_function",
        "_get_jax_state", "_get_iterator", "_enumerate_iterator", "get_metrics_result",
        "compile", "_initialize_layout", "_direct_assign", "apply", "check_finite",
        "stateless_apply", "build", "reduce_values", "get_attr_skipset", "add_update",
        "get_current_value", "get_stateless_scope",
    }  # fmt: skip
    assert expected <= names


def test_a_missing_symbol_names_itself_and_the_supported_versions(monkeypatch):
    monkeypatch.delattr(_internals.loss_module, "reduce_values")
    with pytest.raises(_internals.KerasVersionError) as error:
        _internals.check()
    message = str(error.value)
    assert "keras.src.losses.loss.reduce_values" in message
    assert _internals.SUPPORTED_KERAS in message
    assert "pip install" in message


def test_a_changed_signature_is_refused(monkeypatch):
    monkeypatch.setattr(_internals.saving_lib, "get_attr_skipset", lambda kind: None)
    with pytest.raises(_internals.KerasVersionError, match="get_attr_skipset.*parameters"):
        _internals.check()


def test_an_attribute_no_longer_set_is_refused(monkeypatch):
    def build(self, input_shape):
        self.axes = None

    monkeypatch.setattr(_internals.BatchNormalization, "build", build)
    with pytest.raises(_internals.KerasVersionError, match="_reduction_axes"):
        _internals.check()


def _import_with(patch: str):
    program = textwrap.dedent(
        f"""
        import os
        os.environ["KERAS_BACKEND"] = "jax"
        {patch}
        import keras_dist
        """
    )
    return subprocess.run(
        [sys.executable, "-c", program], capture_output=True, text=True, timeout=120
    )


def test_import_keras_dist_fails_clearly_when_keras_lacks_a_symbol():
    done = _import_with(
        "from keras.src.backend.jax import trainer; del trainer.JAXTrainer._get_jax_state"
    )
    assert done.returncode != 0
    assert "KerasVersionError" in done.stderr
    assert "JAXTrainer._get_jax_state" in done.stderr
    assert _internals.SUPPORTED_KERAS in done.stderr


def test_supported_range_is_declared_in_pyproject():
    pyproject = pathlib.Path(__file__).resolve().parents[2] / "pyproject.toml"
    dependencies = tomllib.loads(pyproject.read_text())["project"]["dependencies"]
    assert f"keras{_internals.SUPPORTED_KERAS}" in dependencies


# ---------------------------------------------- subclasses of Keras's classes
def _our_classes_with_keras_bases():
    import importlib
    import inspect
    import pkgutil

    import keras_dist

    for info in pkgutil.walk_packages(keras_dist.__path__, "keras_dist."):
        module = importlib.import_module(info.name)
        for _, cls in inspect.getmembers(module, inspect.isclass):
            keras_bases = [k for k in cls.__mro__ if k.__module__.split(".")[0] == "keras"]
            if cls.__module__ == module.__name__ and keras_bases:
                yield cls, keras_bases


def _checked(keras_bases, name) -> bool:
    owners = [s.owner for s in _internals.SYMBOLS if s.name == name]
    owners += [owner for owner, method in _internals.METHODS if method == name]
    owners += [owner for owner, _, attribute in _internals.ATTRIBUTES if attribute == name]
    return any(isinstance(o, type) and o in keras_bases for o in owners)


def _private_self_reads(cls) -> set:
    import ast
    import inspect

    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    except (OSError, TypeError):
        return set()
    return {
        node.attr
        for node in ast.walk(tree)
        if isinstance(node, ast.Attribute)
        and isinstance(node.value, ast.Name)
        and node.value.id == "self"
        and node.attr.startswith("_")
        and not node.attr.startswith("__")
    }


def _keras_private_members_used(cls, keras_bases) -> set:
    """Keras's private members ``cls`` overrides or reads through ``self``."""
    ours = [k for k in cls.__mro__ if k.__module__.startswith("keras_dist")]
    defined_by_us = {name for k in ours for name in vars(k)}
    for k in ours:
        defined_by_us |= {n for n in _private_self_reads(k) if f"self.{n} =" in _source_or_empty(k)}
    overridden = {
        name
        for name in vars(cls)
        if name.startswith("_")
        and not name.startswith("__")
        and any(name in vars(k) for k in keras_bases)
    }
    inherited = {
        name
        for name in _private_self_reads(cls) - defined_by_us
        if any(name in vars(k) or f"self.{name}" in _source_or_empty(k) for k in keras_bases)
    }
    return overridden | inherited


def _source_or_empty(cls) -> str:
    import inspect

    try:
        return inspect.getsource(cls)
    except (OSError, TypeError):
        return ""


def test_every_private_keras_member_a_subclass_of_ours_uses_is_checked():
    unchecked = []
    for cls, keras_bases in _our_classes_with_keras_bases():
        for name in sorted(_keras_private_members_used(cls, keras_bases)):
            if not _checked(keras_bases, name):
                unchecked.append(f"{cls.__module__}.{cls.__qualname__}: {name}")
    assert not unchecked, (
        "private Keras members overridden or read through self, missing from "
        "_keras/_internals.py's SYMBOLS/METHODS/ATTRIBUTES:\n" + "\n".join(unchecked)
    )


def test_the_subclass_check_sees_an_unchecked_override_and_inherited_read():
    import keras

    class Planted(keras.callbacks.EarlyStopping):
        def _is_improvement(self, monitor_value, reference_value):  # overridden
            return self._set_monitor_op  # a private Keras method, read

    keras_bases = [k for k in Planted.__mro__ if k.__module__.split(".")[0] == "keras"]
    used = _keras_private_members_used(Planted, keras_bases)
    assert used == {"_is_improvement", "_set_monitor_op"}
    assert not any(_checked(keras_bases, name) for name in used)
