"""Every public name is documented, and the examples in docstrings run."""

import doctest
import importlib
import inspect
import pkgutil

import pytest

import keras_dist as kd

PUBLIC_MODULES = [
    kd,
    kd.callbacks,
    kd.cluster_resolver,
    kd.config,
    kd.data,
    kd.experimental,
    kd.layers,
    kd.nn,
    kd.testing,
    kd.tpu,
    kd.tpu.experimental,
    kd.train,
    kd.errors,
    kd.coordinator,
]


def _public_names():
    for module in PUBLIC_MODULES:
        for name in module.__all__:
            yield module.__name__, name, getattr(module, name)


def _param_id(value):
    # The object's kind, not its repr: a repr holds an address that differs between the
    # processes that collect the tests (pytest-xdist needs the same ids in each).
    return value if isinstance(value, str) else type(value).__name__


@pytest.mark.parametrize("module,name,obj", list(_public_names()), ids=_param_id)
def test_public_name_has_a_docstring(module, name, obj):
    assert (obj.__doc__ or "").strip(), f"{module}.{name} has no docstring"


@pytest.mark.parametrize("module,name,obj", list(_public_names()), ids=_param_id)
def test_public_name_has_an_example(module, name, obj):
    if inspect.ismodule(obj):
        return  # a namespace: its names are checked one by one
    doc = obj.__doc__ or ""
    # A doctest, or (for what starts processes) a literal sketch.
    assert ">>>" in doc or "::\n" in doc, f"{module}.{name} has no example in its docstring"


def _all_modules():
    for info in pkgutil.walk_packages(kd.__path__, prefix="keras_dist."):
        yield info.name


@pytest.mark.parametrize("module_name", sorted(_all_modules()))
def test_docstring_examples_run(module_name):
    module = importlib.import_module(module_name)
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    assert result.failed == 0
