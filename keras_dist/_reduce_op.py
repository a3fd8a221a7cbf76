"""`ReduceOp`: how values from several replicas are combined."""

import enum

import jax.numpy as jnp


class ReduceOp(enum.Enum):
    """Indicates how a set of values from the replicas should be reduced.

    * ``SUM``: add the values of all replicas.
    * ``MEAN``: add them and divide by the number of replicas.

    Strings are accepted wherever a ``ReduceOp`` is, in either case:

    >>> ReduceOp.from_value("sum")
    <ReduceOp.SUM: 'SUM'>
    """

    SUM = "SUM"
    MEAN = "MEAN"

    @classmethod
    def from_value(cls, value: "ReduceOp | str") -> "ReduceOp":
        """Returns the ``ReduceOp`` named by ``value`` (a ReduceOp or a string)."""
        if isinstance(value, cls):
            return value
        if isinstance(value, str) and value.upper() in cls.__members__:
            return cls[value.upper()]
        raise ValueError(
            'Unknown reduce op. Expected ReduceOp.SUM, ReduceOp.MEAN, "SUM", "sum", '
            f'"MEAN" or "mean". Received: reduce_op={value!r}'
        )

    @classmethod
    def from_variable_aggregation(cls, aggregation: str) -> "ReduceOp":
        """Maps a Keras variable ``aggregation`` ("sum" or "mean") to a ReduceOp."""
        if aggregation == "sum":
            return cls.SUM
        if aggregation == "mean":
            return cls.MEAN
        # TF's wording, which TF's tests match ("Could not convert from .*
        # VariableAggregation\.NONE").
        name = str(aggregation).upper()
        raise ValueError(
            f"Could not convert from `tf.VariableAggregation` VariableAggregation.{name} "
            "to a reduce op: only 'sum' and 'mean' map to one, so a variable created "
            f"with aggregation={aggregation!r} cannot be read across replicas (a metric's "
            "result, a sync-on-read variable). Create it with aggregation='sum', 'mean' "
            f"or 'only_first_replica'. Received: aggregation={aggregation!r}"
        )

    def __str__(self) -> str:
        return f"ReduceOp.{self.name}"


def mean_of(total, count, integer_division=False):
    """``total / count``: the ``MEAN`` every reduction path divides its sum by.

    TF's ``MirroredStrategy`` divides a sum of integers into a float (1 and 2 give
    1.5); its collectives across workers, and a variable's own reads, divide them as
    integers (``integer_division``).

    >>> float(mean_of(jnp.int32(3), 2)), int(mean_of(jnp.int32(3), 2, integer_division=True))
    (1.5, 1)
    """
    if integer_division and jnp.issubdtype(jnp.result_type(total), jnp.integer):
        return total // count
    return total / count
