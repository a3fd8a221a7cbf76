"""`ValueContext`: what ``experimental_distribute_values_from_function`` tells ``value_fn``."""

import dataclasses


@dataclasses.dataclass(frozen=True)
class ValueContext:
    """Which replica a value is being made for.

    >>> ValueContext(replica_id_in_sync_group=1, num_replicas_in_sync=2)
    ValueContext(replica_id_in_sync_group=1, num_replicas_in_sync=2)
    """

    replica_id_in_sync_group: int = 0
    num_replicas_in_sync: int = 1
