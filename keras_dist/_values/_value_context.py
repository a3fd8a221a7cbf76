"""`ValueContext`: what ``experimental_distribute_values_from_function`` tells ``value_fn``."""

import dataclasses


@dataclasses.dataclass(frozen=True)
class ValueContext:
    """Which replica a value is being made for.

    ``str()`` is TF's text (double space included), for logs compared with TF's.

    >>> ValueContext(replica_id_in_sync_group=1, num_replicas_in_sync=2)
    ValueContext(replica_id_in_sync_group=1, num_replicas_in_sync=2)
    >>> print(ValueContext(1, 2))
    tf.distribute.ValueContext(replica id 1,  total replicas in sync: 2)
    """

    replica_id_in_sync_group: int = 0
    num_replicas_in_sync: int = 1

    def __str__(self):
        return (
            f"tf.distribute.ValueContext(replica id {self.replica_id_in_sync_group},  "
            f"total replicas in sync: {self.num_replicas_in_sync})"
        )
