"""What a task's process runs: a pickled function, or a script.

A program gives the command line of each task and reads back what the task produced.
``FunctionProgram`` serves ``MultiProcessRunner`` and ``launch``; ``ScriptProgram`` serves
the ``keras-dist launch`` command.
"""

import collections
import functools
import importlib.metadata
import io
import os
import pickle
import sys
import types
from typing import Any
from typing import NamedTuple

import cloudpickle

from keras_dist._launch import _worker

_WORKER_PATH = os.path.abspath(_worker.__file__)


class RemoteFailure(NamedTuple):
    """An exception raised by a task's function, as the task reported it."""

    type_name: str
    message: str
    traceback: str
    exception: BaseException | None  # None when it could not be pickled or unpickled.


class Outcome(NamedTuple):
    """What one run of a task produced: a return value, a failure, or neither."""

    returned: bool
    value: Any = None
    failure: RemoteFailure | None = None


class FunctionProgram:
    """Each task calls ``fn(*args, **kwargs)`` and sends back its return value or exception."""

    returns_values = True

    def __init__(self, fn, args=(), kwargs=None):
        if not callable(fn):
            raise TypeError(f"`fn` must be callable. Received: fn={fn!r}")
        try:
            call = _dumps((fn, tuple(args), dict(kwargs or {})), _modules_of(fn))
        except Exception as error:
            raise TypeError(
                "`fn`, `args` and `kwargs` must be picklable with cloudpickle to reach the "
                f"tasks ({type(error).__name__}: {error}). Received: fn={fn!r}"
            ) from error
        self._spec = {"sys_path": list(sys.path), "parent_pid": os.getpid(), "call": call}
        self._workdir = None

    def setup(self, workdir: str) -> None:
        self._workdir = workdir
        with open(os.path.join(workdir, "call.pkl"), "wb") as file:
            pickle.dump(self._spec, file)

    def command(self, task_type: str, task_id: int) -> list[str]:
        call = os.path.join(self._workdir, "call.pkl")
        return [sys.executable, _WORKER_PATH, call, self._result_path(task_type, task_id)]

    def clear(self, task_type: str, task_id: int) -> None:
        """Forgets the result of an earlier run of the task (before a restart)."""
        try:
            os.remove(self._result_path(task_type, task_id))
        except FileNotFoundError:
            pass

    def read_outcome(self, task_type: str, task_id: int) -> Outcome:
        try:
            with open(self._result_path(task_type, task_id), "rb") as file:
                result = pickle.load(file)
        except FileNotFoundError:
            return Outcome(returned=False)
        if result["ok"]:
            try:
                return Outcome(returned=True, value=cloudpickle.loads(result["value"]))
            except Exception as error:
                return Outcome(
                    returned=False,
                    failure=RemoteFailure(
                        type(error).__qualname__,
                        f"The return value could not be unpickled here: {error}",
                        "",
                        None,
                    ),
                )
        exception = None
        if result["exception"] is not None:
            try:
                exception = cloudpickle.loads(result["exception"])
            except Exception:
                # Its class is unknown here, or its __init__ takes other arguments.
                exception = None
        failure = RemoteFailure(
            result["type_name"], result["message"], result["traceback"], exception
        )
        return Outcome(returned=False, failure=failure)

    def _result_path(self, task_type: str, task_id: int) -> str:
        return os.path.join(self._workdir, f"result-{task_type}-{task_id}.pkl")


class ScriptProgram:
    """Each task runs ``python script args`` (or ``python -m module args``); no return value."""

    returns_values = False

    def __init__(self, script: str, script_args=(), module: bool = False):
        self._argv = ["-m", script] if module else [script]
        self._argv += list(script_args)

    def setup(self, workdir: str) -> None:
        del workdir

    def command(self, task_type: str, task_id: int) -> list[str]:
        del task_type, task_id
        return [sys.executable, *self._argv]

    def clear(self, task_type: str, task_id: int) -> None:
        del task_type, task_id

    def read_outcome(self, task_type: str, task_id: int) -> Outcome:
        del task_type, task_id
        return Outcome(returned=False)


# cloudpickle (3.1.3 and later) names the code of a function sent by value
# "<dynamic-code>", so a task's traceback would show no source lines. The tasks run
# on this machine, where the file is: keep its name.
_REDUCE_CODE = cloudpickle.Pickler.dispatch_table[types.CodeType]
_DYNAMIC_CODE = "<dynamic-code>"


def _code_with_its_file(code):
    constructor, arguments = _REDUCE_CODE(code)
    arguments = tuple(code.co_filename if a == _DYNAMIC_CODE else a for a in arguments)
    return constructor, arguments


class _Pickler(cloudpickle.Pickler):
    """cloudpickle's pickler; a function sent by value keeps its file name (tracebacks)."""

    dispatch_table = collections.ChainMap(
        {types.CodeType: _code_with_its_file}, cloudpickle.Pickler.dispatch_table
    )


def _dumps(obj, modules) -> bytes:
    """cloudpickle ``obj``, taking ``modules`` by value (the tasks could not import them)."""
    registered = []
    try:
        for module in modules:
            try:
                cloudpickle.register_pickle_by_value(module)
                registered.append(module)
            except ValueError:
                pass  # Already registered by the user.
        buffer = io.BytesIO()
        _Pickler(buffer, protocol=pickle.DEFAULT_PROTOCOL).dump(obj)
        return buffer.getvalue()
    finally:
        for module in registered:
            cloudpickle.unregister_pickle_by_value(module)


def _modules_of(fn) -> list:
    """The modules of ``fn`` that a task must receive by value.

    cloudpickle sends functions of ``__main__`` (scripts, notebooks) by value already; a
    function of any other module goes by reference, which fails in the task when the module
    is not installed (a pytest test file, a helper next to a script) and re-runs its imports.
    Modules of installed distributions and of the standard library go by reference.
    """
    while isinstance(fn, functools.partial):
        fn = fn.func
    module = sys.modules.get(getattr(fn, "__module__", None) or "")
    if module is None or module.__name__ in ("__main__", "__mp_main__"):
        return []
    top_level = module.__name__.partition(".")[0]
    if top_level in sys.stdlib_module_names or top_level in _installed_top_levels():
        return []
    return [module]


@functools.cache
def _installed_top_levels() -> frozenset[str]:
    return frozenset(importlib.metadata.packages_distributions())
