"""How distributed input is configured: ``InputOptions``, ``InputContext`` and modes."""

import dataclasses
import enum


class InputReplicationMode(enum.Enum):
    """How ``distribute_datasets_from_function`` creates input pipelines.

    * ``PER_WORKER``: one pipeline per worker; its batches go to the worker's
      replicas in turn.
    * ``PER_REPLICA``: one pipeline per replica (``dataset_fn`` is called once
      per replica).

    >>> import numpy as np, keras_dist as kd
    >>> strategy = kd.MirroredStrategy(["/cpu:0", "/cpu:1"])
    >>> options = kd.InputOptions(
    ...     experimental_replication_mode=kd.InputReplicationMode.PER_REPLICA)
    >>> dataset = strategy.distribute_datasets_from_function(
    ...     lambda ctx: [np.full(2, ctx.input_pipeline_id, "float32")], options)
    >>> [v.tolist() for v in strategy.experimental_local_results(next(iter(dataset)))]
    [[0.0, 0.0], [1.0, 1.0]]
    """

    PER_WORKER = "PER_WORKER"
    PER_REPLICA = "PER_REPLICA"


@dataclasses.dataclass
class InputOptions:
    """Options for distributed input, as ``tf.distribute.InputOptions``.

    As TF's, they are checked by ``distribute_datasets_from_function`` only:
    ``experimental_distribute_dataset`` ignores the placement options.

    >>> InputOptions(experimental_replication_mode=InputReplicationMode.PER_REPLICA)
    ... # doctest: +ELLIPSIS
    InputOptions(experimental_fetch_to_device=True, ...)
    """

    experimental_fetch_to_device: bool = True
    experimental_replication_mode: InputReplicationMode = InputReplicationMode.PER_WORKER
    experimental_place_dataset_on_device: bool = False
    experimental_per_replica_buffer_size: int = 1

    def validate(self, dataset_fn: bool = True) -> None:
        """Raises ``ValueError`` for options that contradict each other.

        ``dataset_fn=False`` (``experimental_distribute_dataset``) checks only
        the buffer size, as TF, which ignores the placement options there.
        """
        if dataset_fn and self.experimental_place_dataset_on_device:
            if self.experimental_replication_mode is InputReplicationMode.PER_WORKER:
                raise ValueError(
                    "`experimental_place_dataset_on_device=True` needs "
                    "`experimental_replication_mode=InputReplicationMode.PER_REPLICA`. "
                    "Received: " + repr(self)
                )
            if self.experimental_fetch_to_device:
                raise ValueError(
                    "`experimental_place_dataset_on_device` cannot be combined with "
                    "`experimental_fetch_to_device=True`: a dataset placed on the device "
                    "is already there; set `experimental_fetch_to_device=False` (it is True "
                    "unless set). Received: " + repr(self)
                )
        if self.experimental_per_replica_buffer_size < 0:
            raise ValueError(
                "`experimental_per_replica_buffer_size` must be at least 0. Received: "
                f"{self.experimental_per_replica_buffer_size}"
            )


def checked_input_options(options, method: str) -> "InputOptions | None":
    """``options`` if it is ``None`` or an ``InputOptions``; else a ``TypeError`` naming the fix.

    >>> checked_input_options("bad", "experimental_distribute_dataset")
    Traceback (most recent call last):
    ...
    TypeError: `experimental_distribute_dataset` takes `options=kd.InputOptions(...)`
    (or None). Received: options='bad' of type str
    """
    if options is None or isinstance(options, InputOptions):
        return options
    raise TypeError(
        f"`{method}` takes `options=kd.InputOptions(...)` (or None). "
        f"Received: options={options!r} of type {type(options).__name__}"
    )


class InputContext:
    """Tells ``dataset_fn`` which input pipeline it builds and for how many replicas.

    >>> ctx = InputContext(num_input_pipelines=2, input_pipeline_id=1, num_replicas_in_sync=6)
    >>> ctx.get_per_replica_batch_size(12)
    2
    """

    def __init__(self, num_input_pipelines=1, input_pipeline_id=0, num_replicas_in_sync=1):
        self._num_input_pipelines = num_input_pipelines
        self._input_pipeline_id = input_pipeline_id
        self._num_replicas_in_sync = num_replicas_in_sync

    @property
    def num_replicas_in_sync(self) -> int:
        """The number of replicas in sync, all pipelines together."""
        return self._num_replicas_in_sync

    @property
    def input_pipeline_id(self) -> int:
        """This pipeline's index, in ``[0, num_input_pipelines)``; shard by it."""
        return self._input_pipeline_id

    @property
    def num_input_pipelines(self) -> int:
        """How many input pipelines there are (one per worker by default)."""
        return self._num_input_pipelines

    def get_per_replica_batch_size(self, global_batch_size: int) -> int:
        """``global_batch_size // num_replicas_in_sync``; it must divide evenly."""
        if global_batch_size % self._num_replicas_in_sync != 0:
            raise ValueError(
                f"The `global_batch_size` {global_batch_size} is not divisible by "
                f"`num_replicas_in_sync` {self._num_replicas_in_sync}. Choose a global "
                "batch size that is a multiple of the replica count. Received: "
                f"global_batch_size={global_batch_size}, "
                f"num_replicas_in_sync={self._num_replicas_in_sync}."
            )
        return global_batch_size // self._num_replicas_in_sync

    def __str__(self):
        return (
            f"tf.distribute.InputContext(input pipeline id {self._input_pipeline_id}, "
            f"total: {self._num_input_pipelines})"
        )

    __repr__ = __str__
