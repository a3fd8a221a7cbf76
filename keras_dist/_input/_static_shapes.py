"""Whether a dataset's elements all have one known shape, as TF reads it off ``element_spec``.

TF gives a replica with no element left an empty batch only when the element
shapes are not static (its partial-batch handling); when they are (unbatched
elements, or ``batch(n, drop_remainder=True)``), the input ends at the first
step that some replica has no element for. ``distribute_datasets_from_function``
follows it on one worker (TF: partial batches are always handled across workers).
"""

import jax
import numpy as np


def statically_shaped(dataset) -> bool:
    """True for a ``NumpyDataset`` or ``tf.data.Dataset`` whose elements all share one shape.

    Other sources (lists, generators, Grain datasets) do not say, so they count
    as not static: a replica that runs out gets empty batches.

    >>> import numpy as np
    >>> from keras_dist._input import NumpyDataset
    >>> rows = NumpyDataset(np.arange(6.0))
    >>> statically_shaped(rows), statically_shaped(rows.batch(4))
    (True, False)
    >>> statically_shaped(rows.batch(4, drop_remainder=True)), statically_shaped([rows])
    (True, False)
    """
    static = getattr(dataset, "static_shapes", None)
    if isinstance(static, bool):
        return static
    if not (type(dataset).__module__ or "").startswith("tensorflow"):
        return False
    specs = jax.tree_util.tree_leaves(getattr(dataset, "element_spec", None))
    return bool(specs) and all(_fully_defined(spec) for spec in specs)


def _fully_defined(spec) -> bool:
    shape = getattr(spec, "shape", None)
    is_fully_defined = getattr(shape, "is_fully_defined", None)
    return bool(is_fully_defined and is_fully_defined())


def has_scalar_leaf(structure) -> bool:
    """Whether a nest holds a 0-d array, which has no empty batch to stand in for it."""
    return any(np.ndim(x) == 0 for x in jax.tree_util.tree_leaves(structure))
