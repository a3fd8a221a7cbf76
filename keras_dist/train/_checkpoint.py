"""``kd.train.Checkpoint``: ``tf.train.Checkpoint`` for Keras objects under a strategy.

A checkpoint groups the objects of a training (``Checkpoint(model=m,
optimizer=o, step=v)``) and saves or restores all their variables at once. A
value is stored under the key of the path that reaches it from the checkpoint:
``model/3`` is the model's fourth variable, ``inner/step`` the variable
``step`` of a nested checkpoint, ``save_counter`` the counter that numbers
``save``'s files. See ``_objects`` for what each kind of object saves and
``_format`` for the file.

Every process of a multi-worker job calls ``save``/``write`` (reading a
distributed variable can be a collective); only the chief writes at the path
it was given, the others into ``workertemp_<id>`` directories that they remove
at once (TF's rule, ``cluster_resolver._role``). Every process can restore.
"""

import os

import jax
import keras
import numpy as np

from keras_dist._context import running_replica_context
from keras_dist.train import _format
from keras_dist.train import _objects
from keras_dist.train import _state
from keras_dist.train._status import CheckpointLoadStatus
from keras_dist.train._status import InitializationOnlyStatus


class Checkpoint:
    """Saves and restores Keras models, optimizers, metrics and variables together.

    ``tf.train.Checkpoint``'s counterpart. Keyword arguments name the objects:
    Keras models and layers, optimizers, metrics, variables (keras_dist's
    ``MirroredVariable`` and ``SyncOnReadVariable`` included), lists and dicts
    of them, and other ``Checkpoint``s; a ``tf.Variable`` (a tutorial's step
    counter) is saved and restored as a variable too. More can be added later
    as attributes (``checkpoint.step = keras.Variable(0)``). Variables are matched by the
    object that holds them and their position in it, not by name.

    Call ``save``, ``write``, ``restore`` and ``read`` in the cross-replica
    context (outside ``strategy.run``).

    >>> import os, tempfile, keras, keras_dist as kd
    >>> step = keras.Variable(5)
    >>> checkpoint = kd.train.Checkpoint(step=step)
    >>> path = checkpoint.save(os.path.join(tempfile.mkdtemp(), "ckpt"))
    >>> os.path.basename(path)
    'ckpt-1'
    >>> _ = step.assign(9)
    >>> _ = checkpoint.restore(path)
    >>> int(step.numpy())
    5
    """

    def __init__(self, **kwargs):
        self._children = {}
        self._save_counter = None
        for name, obj in kwargs.items():
            setattr(self, name, obj)

    def __setattr__(self, name, value):
        if name.startswith("_"):
            object.__setattr__(self, name, value)
            return
        if hasattr(type(self), name):
            raise ValueError(
                f"`Checkpoint` uses the name `{name}` itself; give the object another name. "
                f"Received: {name}={value!r}"
            )
        _check_trackable(name, value)
        self._children[name] = value

    def __getattr__(self, name):
        children = self.__dict__.get("_children", {})
        if name in children:
            return children[name]
        raise AttributeError(f"'Checkpoint' object has no attribute {name!r}")

    def __repr__(self) -> str:
        return f"Checkpoint({', '.join(self._children)})"

    def tracked_objects(self) -> list:
        """``(key, object)`` for everything this checkpoint saves, keyed as in its files.

        Nested checkpoints are opened (``"inner/model"``); the save counter is
        included once it exists.

        >>> import keras, keras_dist as kd
        >>> [key for key, _ in kd.train.Checkpoint(step=keras.Variable(0)).tracked_objects()]
        ['step']
        """
        return _checkpoint_leaves(self, "", set())

    @property
    def own_objects(self) -> list:
        """``(name, object)`` for what this checkpoint holds itself, nested ones unopened.

        The save counter once it exists, then the objects it was given.
        """
        counter = [] if self._save_counter is None else [("save_counter", self._save_counter)]
        return counter + list(self._children.items())

    @property
    def save_counter(self):
        """The variable that counts ``save`` calls and numbers their files (created on use).

        It is saved with the checkpoint and restored by ``restore``.

        >>> import keras_dist as kd
        >>> int(kd.train.Checkpoint().save_counter.numpy())
        0
        """
        if self._save_counter is None:
            self._save_counter = keras.Variable(
                0, dtype="int32", trainable=False, name="save_counter"
            )
        return self._save_counter

    def save(self, file_prefix, options=None) -> str:
        """Saves a numbered checkpoint ``<file_prefix>-<n>`` and records it as the latest.

        ``n`` is ``save_counter`` after it is incremented. The directory's
        ``checkpoint`` file then names this checkpoint (``kd.train.latest_checkpoint``).
        Returns the checkpoint's path, to pass to ``restore``.

        >>> import os, tempfile, keras, keras_dist as kd
        >>> checkpoint = kd.train.Checkpoint(v=keras.Variable(1.0))
        >>> prefix = os.path.join(tempfile.mkdtemp(), "ckpt")
        >>> [os.path.basename(checkpoint.save(prefix)) for _ in range(2)]
        ['ckpt-1', 'ckpt-2']
        """
        _refuse_in_replica("save")
        counter = self.save_counter
        counter.assign_add(1)
        path = f"{os.fspath(file_prefix)}-{_objects.as_int(counter)}"
        if write_checkpoint(self, path):
            _state.write_state(os.path.dirname(path) or ".", path, [path])
        wait_for_writer(self)
        return path

    def write(self, file_prefix, options=None) -> str:
        """Writes a checkpoint at ``file_prefix`` (no number, no ``checkpoint`` file update).

        Returns ``file_prefix``. The file appears whole or not at all.

        >>> import os, tempfile, keras, keras_dist as kd
        >>> prefix = os.path.join(tempfile.mkdtemp(), "weights")
        >>> kd.train.Checkpoint(v=keras.Variable(1.0)).write(prefix) == prefix
        True
        """
        file_prefix = os.fspath(file_prefix)
        write_checkpoint(self, file_prefix)
        wait_for_writer(self)
        return file_prefix

    def restore(self, save_path, options=None):
        """Restores the checkpoint ``save_path`` (``save_counter`` included); returns a status.

        ``save_path`` is a path returned by ``save``/``write`` or
        ``latest_checkpoint``, or a directory (its latest checkpoint). ``None``
        restores nothing (as in TF). Values are assigned before this returns;
        an optimizer whose slots do not exist yet is built for the model in the
        checkpoint first. A checkpoint that cannot be decoded raises
        ``CheckpointUnreadableError`` naming its file, and nothing is assigned.

        >>> import os, tempfile, keras, keras_dist as kd
        >>> v = keras.Variable(1.0)
        >>> path = kd.train.Checkpoint(v=v).save(os.path.join(tempfile.mkdtemp(), "c"))
        >>> restored = kd.train.Checkpoint(v=keras.Variable(0.0))
        >>> restored.restore(path).assert_consumed().save_path == path
        True
        >>> int(restored.save_counter.numpy())
        1
        """
        if save_path is None:
            return InitializationOnlyStatus()
        _refuse_in_replica("restore")
        self.save_counter  # noqa: B018 -- restore gives the counter its saved value, as TF's does
        return self.read(save_path, options)

    def read(self, save_path, options=None):
        """Restores the checkpoint ``save_path`` without creating ``save_counter``.

        ``write``'s counterpart; see ``restore``.

        >>> import os, tempfile, keras, keras_dist as kd
        >>> prefix = os.path.join(tempfile.mkdtemp(), "w")
        >>> _ = kd.train.Checkpoint(v=keras.Variable(2.0)).write(prefix)
        >>> v = keras.Variable(0.0)
        >>> kd.train.Checkpoint(v=v).read(prefix).assert_consumed().unused_keys
        []
        >>> float(v.numpy())
        2.0
        """
        if save_path is None:
            return InitializationOnlyStatus()
        _refuse_in_replica("read")
        save_path = _resolve(os.fspath(save_path))
        saved, saved_paths = _format.read(save_path)
        variables = _variables_for_restore(self, saved, save_path)
        restored, missing, mismatched = {}, {}, []
        for key, variable in variables.items():
            if key not in saved:
                missing[key] = variable.path
            elif tuple(saved[key].shape) != tuple(variable.shape):
                mismatched.append(
                    f"{key} ({variable.path}): checkpoint shape {tuple(saved[key].shape)}, "
                    f"variable shape {tuple(variable.shape)}"
                )
            elif _canonical(saved[key].dtype) != _canonical(variable.dtype):
                # TF refuses too: a cast would restore other values than were saved.
                mismatched.append(
                    f"{key} ({variable.path}): checkpoint dtype {saved[key].dtype}, "
                    f"variable dtype {variable.dtype}"
                )
            else:
                restored[key] = variable.path
        if mismatched:
            raise ValueError(
                f"The checkpoint {save_path!r} does not fit these objects; nothing was "
                "restored. Received: " + "; ".join(mismatched)
            )
        for key in restored:
            _objects.assign(variables[key], saved[key])
        unused = {key: saved_paths.get(key, key) for key in saved if key not in variables}
        return CheckpointLoadStatus(save_path, restored, unused, missing)


def _refuse_in_replica(method: str) -> None:
    if running_replica_context() is not None:
        raise RuntimeError(
            f"`Checkpoint.{method}` must be called in the cross-replica context (outside "
            "`strategy.run`). Received: a call inside a replica function"
        )


def _canonical(dtype) -> np.dtype:
    """``dtype`` as JAX holds it (int64 is int32 without x64): a saved value's dtype."""
    return jax.dtypes.canonicalize_dtype(keras.backend.standardize_dtype(dtype))


def _check_trackable(name, value) -> None:
    if isinstance(value, Checkpoint) or _objects.is_leaf(value):
        return
    if isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            _check_trackable(f"{name}[{i}]", item)
        return
    if isinstance(value, dict):
        for key, item in value.items():
            _check_trackable(f"{name}[{key!r}]", item)
        return
    raise ValueError(
        f"`Checkpoint` was expecting `{name}` to be a Keras model, layer, optimizer, "
        "metric or variable (or a `tf.Variable`), a list or dict of them, or a `Checkpoint`. "
        f"Received: {name}={_objects.describe(value)}"
    )


def _variables(leaves) -> dict:
    variables = {}
    for key, obj in leaves:
        variables.update(_objects.variables_of(key, obj))
    return variables


def write_checkpoint(checkpoint: Checkpoint, save_path: str) -> bool:
    """Writes ``checkpoint`` at ``save_path``; whether this process wrote at that path.

    A non-chief writes into its ``workertemp_<id>`` directory and removes it.
    """
    _refuse_in_replica("write")
    variables = _variables(checkpoint.tracked_objects())
    values = {key: _objects.host_value(variable) for key, variable in variables.items()}
    paths = {key: variable.path for key, variable in variables.items()}
    role = _objects.process_role(variables.values())
    directory, name = os.path.split(os.path.abspath(save_path))
    write_directory = role.write_dirpath(directory)
    try:
        _format.write(os.path.join(write_directory, name), values, paths)
    finally:
        role.remove_temp_dirpath(directory)  # a non-chief's, written or not
    return write_directory == directory


def wait_for_writer(checkpoint: Checkpoint) -> None:
    """With several processes: returns once the chief has written (then all can restore)."""
    _objects.wait_for_every_process(_variables(checkpoint.tracked_objects()).values())


def _resolve(save_path: str) -> str:
    if os.path.isdir(save_path) and not _format.exists(save_path):
        latest = _state.latest_checkpoint(save_path)
        if latest is None:
            raise FileNotFoundError(
                f"The directory {save_path!r} holds no checkpoint (no `checkpoint` file "
                f"naming one). Received: save_path={save_path!r}"
            )
        return latest
    return save_path


def _variables_for_restore(checkpoint: Checkpoint, saved: dict, save_path: str) -> dict:
    """Every variable to restore, by key, after building what must exist first."""
    leaves = checkpoint.tracked_objects()
    models = list({id(obj): obj for _, obj in leaves if _objects.is_model(obj)}.values())
    # Every unbuilt model is refused before an optimizer is built for one: nothing changes.
    for key, obj in leaves:
        saved_count = sum(1 for k in saved if k.startswith(f"{key}/"))
        unbuilt = not _objects.is_variable(obj) and not obj.variables
        if unbuilt and saved_count and not _objects.is_unbuilt_optimizer(obj):
            raise ValueError(
                f"`{key}` ({_objects.describe(obj)}) has no variables yet, and the checkpoint "
                f"{save_path!r} holds {saved_count} for it. Build it before restoring "
                "(call it on a batch, or `model.build(input_shape)`): TF's restore waits "
                "for the variables to be created, keras_dist's assigns at once."
            )
    for key, obj in leaves:
        saved_count = sum(1 for k in saved if k.startswith(f"{key}/"))
        if _objects.is_unbuilt_optimizer(obj) and saved_count > len(obj.variables):
            if len(models) != 1:
                raise ValueError(
                    f"The optimizer `{key}` has not created its variables yet, and the "
                    f"checkpoint {save_path!r} holds them. Build it before restoring: "
                    "`optimizer.build(model.trainable_variables)` (done for you when the "
                    f"checkpoint holds exactly one model). Received: {len(models)} models"
                )
            _objects.build_optimizer(obj, models[0])
    return _variables(leaves)


def _checkpoint_leaves(checkpoint: Checkpoint, prefix: str, seen: set) -> list:
    """A checkpoint's ``tracked_objects``; one reached again (a circle) adds nothing."""
    if id(checkpoint) in seen:
        return []
    seen.add(id(checkpoint))
    return [
        leaf
        for name, obj in checkpoint.own_objects
        for leaf in _leaves(f"{prefix}{name}", obj, seen)
    ]


def _leaves(key: str, obj, seen: set) -> list:
    """``(key, object)`` for each object under ``obj``: lists, dicts and checkpoints opened."""
    if isinstance(obj, Checkpoint):
        return _checkpoint_leaves(obj, f"{key}/", seen)
    if isinstance(obj, (list, tuple)):
        items = enumerate(obj)
    elif isinstance(obj, dict):
        items = obj.items()
    else:
        return [(key, obj)]
    return [leaf for k, item in items for leaf in _leaves(f"{key}/{k}", item, seen)]
