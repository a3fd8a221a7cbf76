"""`RunOptions`: options of ``strategy.run``, accepted for TF compatibility."""

import dataclasses


@dataclasses.dataclass(frozen=True)
class RunOptions:
    """Options for ``strategy.run``.

    JAX compiles every replica function with static shapes, so TF's dynamic
    batch-size and bucketizing options have no effect here; they are accepted
    so that TF code runs unchanged.

    >>> RunOptions(experimental_enable_dynamic_batch_size=False)
    ... # doctest: +ELLIPSIS
    RunOptions(experimental_enable_dynamic_batch_size=False, ...)
    """

    experimental_enable_dynamic_batch_size: bool = True
    experimental_bucketizing_dynamic_shape: bool = False
    experimental_xla_options: object = None
