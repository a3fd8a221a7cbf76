"""Auto-sharding of input between workers, with TF's policies.

Each worker (input pipeline) must read a different part of the data. As in
``tf.data.Options().experimental_distribute.auto_shard_policy``:

* ``FILE``: each worker reads only its files (``files[index::num_shards]``);
  needs a file-backed dataset (``FileDataset``) with at least one file per
  worker.
* ``DATA``: every worker reads everything and keeps every ``num_shards``-th
  element.
* ``AUTO`` (the default): ``FILE`` when the dataset is file-backed with enough
  files, else ``DATA`` (with a warning, as TF logs one).
* ``OFF``: every worker gets all of the data.

Set the policy per dataset with ``kd.data.with_auto_shard_policy(dataset,
policy)``; ``kd.data.auto_shard(dataset, input_context)`` applies it for one
input pipeline.
"""

import enum
import warnings


class AutoShardPolicy(enum.Enum):
    """How a dataset is split between workers (``tf.data.experimental.AutoShardPolicy``).

    >>> ds = with_auto_shard_policy(range(6), AutoShardPolicy.OFF)
    >>> list(auto_shard(ds, num_shards=2, index=1))
    [0, 1, 2, 3, 4, 5]
    """

    AUTO = 0
    FILE = 1
    DATA = 2
    OFF = -1


class FileDataset:
    """Records read from a list of files by ``reader(path) -> iterable of records``.

    Re-iterable; FILE sharding gives each worker a subset of the files.

    >>> ds = FileDataset(["a", "b"], reader=lambda path: [path + "0", path + "1"])
    >>> list(ds)
    ['a0', 'a1', 'b0', 'b1']
    """

    def __init__(self, files, reader):
        self.files = list(files)
        self.reader = reader

    def __iter__(self):
        for path in self.files:
            yield from self.reader(path)

    def shard_files(self, num_shards: int, index: int) -> "FileDataset":
        """The dataset of every ``num_shards``-th file from ``index`` (FILE auto-sharding).

        >>> FileDataset(["a", "b", "c"], reader=lambda path: [path]).shard_files(2, 1).files
        ['b']
        """
        return FileDataset(self.files[index::num_shards], self.reader)


class _WithPolicy:
    """A dataset carrying its auto-shard policy; iterates as the dataset does."""

    def __init__(self, dataset, policy):
        self.dataset = dataset
        self.auto_shard_policy = policy

    def __iter__(self):
        return iter(self.dataset)

    def __len__(self):
        return len(self.dataset)


def with_auto_shard_policy(dataset, policy: "AutoShardPolicy | str"):
    """``dataset`` with ``policy`` attached (the counterpart of ``dataset.with_options``).

    >>> ds = with_auto_shard_policy(range(4), "DATA")
    >>> list(auto_shard(ds, num_shards=2, index=1))
    [1, 3]
    """
    if isinstance(policy, str):
        if policy.upper() not in AutoShardPolicy.__members__:
            raise ValueError(
                "Unknown auto-shard policy. Expected one of AUTO, FILE, DATA, OFF. "
                f"Received: policy={policy!r}"
            )
        policy = AutoShardPolicy[policy.upper()]
    return _WithPolicy(getattr(dataset, "dataset", dataset), policy)


class _EveryNth:
    def __init__(self, dataset, num_shards, index):
        self.dataset, self.num_shards, self.index = dataset, num_shards, index

    def __iter__(self):
        for position, element in enumerate(self.dataset):
            if position % self.num_shards == self.index:
                yield element


def auto_shard(dataset, input_context=None, *, num_shards=None, index=None):
    """This input pipeline's part of ``dataset``, by the dataset's auto-shard policy.

    Give an ``InputContext`` (its ``num_input_pipelines`` and
    ``input_pipeline_id``) or ``num_shards`` and ``index``. A ``tf.data.Dataset``'s
    own ``options().experimental_distribute.auto_shard_policy`` is honoured.

    >>> files = FileDataset(["a", "b", "c", "d"], reader=lambda path: [path])
    >>> list(auto_shard(files, num_shards=2, index=0))
    ['a', 'c']
    >>> list(auto_shard(with_auto_shard_policy(range(6), "DATA"), num_shards=3, index=2))
    [2, 5]
    """
    if input_context is not None:
        num_shards = input_context.num_input_pipelines
        index = input_context.input_pipeline_id
    if num_shards is None or index is None or not 0 <= index < num_shards:
        raise ValueError(
            "auto_shard needs an InputContext, or num_shards and an index in "
            f"[0, num_shards). Received: num_shards={num_shards}, index={index}"
        )
    policy = policy_of(dataset) or AutoShardPolicy.AUTO
    dataset = getattr(dataset, "dataset", dataset)
    if num_shards == 1 or policy is AutoShardPolicy.OFF:
        return dataset
    if policy is AutoShardPolicy.FILE:
        if not isinstance(dataset, FileDataset):
            raise ValueError(
                "Could not apply FILE based sharding: the dataset is not file-based. Read "
                "it through keras_dist.data.FileDataset, or use AutoShardPolicy.DATA. "
                f"Received: {type(dataset).__name__}"
            )
        _check_enough_files(dataset, num_shards)
        return dataset.shard_files(num_shards, index)
    if policy is AutoShardPolicy.AUTO:
        if isinstance(dataset, FileDataset) and len(dataset.files) >= num_shards:
            return dataset.shard_files(num_shards, index)
        warnings.warn(
            "AutoShardPolicy.AUTO could not shard the dataset by files (it is not a "
            "FileDataset with at least one file per worker); falling back to DATA: each "
            "worker reads all of the data and keeps every "
            f"{num_shards}-th element.",
            stacklevel=2,
        )
    return _EveryNth(dataset, num_shards, index)


def _check_enough_files(dataset, num_shards):
    if len(dataset.files) < num_shards:
        raise ValueError(
            f"Could not apply FILE based sharding: the dataset only has "
            f"{len(dataset.files)} file(s), which is not enough for the required "
            f"{num_shards} shards/workers. Use more files, fewer workers, or "
            "AutoShardPolicy.DATA. Received: files="
            f"{len(dataset.files)}, num_shards={num_shards}"
        )


def policy_of(dataset) -> "AutoShardPolicy | None":
    """The policy attached to ``dataset`` (``with_auto_shard_policy``, a tf.data option), if any.

    >>> policy_of(with_auto_shard_policy(range(4), "OFF")), policy_of(range(4))
    (<AutoShardPolicy.OFF: -1>, None)
    """
    policy = getattr(dataset, "auto_shard_policy", None)
    if isinstance(policy, AutoShardPolicy):
        return policy
    name = tf_data_auto_shard_policy_name(dataset)
    if name is None:
        return None
    return AutoShardPolicy.__members__.get(name, AutoShardPolicy.AUTO)  # TF's HINT: AUTO


def without_policy(dataset):
    """The dataset ``with_auto_shard_policy`` wrapped (``dataset`` itself otherwise)."""
    return dataset.dataset if isinstance(dataset, _WithPolicy) else dataset


def tf_data_auto_shard_policy_name(dataset) -> "str | None":
    """The name of a ``tf.data.Dataset``'s ``auto_shard_policy`` option, else ``None``."""
    if not (type(dataset).__module__ or "").startswith("tensorflow"):
        return None
    options = getattr(dataset, "options", None)
    if not callable(options):
        return None
    try:
        policy = options().experimental_distribute.auto_shard_policy
    except AttributeError:
        return None
    return getattr(policy, "name", None)
