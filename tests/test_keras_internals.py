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
    pyproject = pathlib.Path(__file__).resolve().parent.parent / "pyproject.toml"
    dependencies = tomllib.loads(pyproject.read_text())["project"]["dependencies"]
    assert f"keras{_internals.SUPPORTED_KERAS}" in dependencies
