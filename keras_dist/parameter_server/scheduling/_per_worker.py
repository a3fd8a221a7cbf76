"""Values and datasets that exist once per worker (``kd.coordinator.PerWorkerValues``).

``PerWorkerValues`` holds one value per worker; passed to a scheduled
function, each worker gets its own. A ``PerWorkerDataset`` is built on every
worker by its dataset function; ``iter()`` of it gives a ``PerWorkerIterator``
whose ``next()`` inside a scheduled function reads the worker's own data.
"""

import itertools

import cloudpickle
import jax
import numpy as np

_ids = itertools.count()


def new_resource_id(prefix: str) -> str:
    return f"{prefix}{next(_ids)}"


class PerWorkerValues:
    """One value per worker, in worker order (TF's ``PerWorkerValues``).

    >>> values = PerWorkerValues((1.0, 2.0))
    >>> values.values
    (1.0, 2.0)
    """

    def __init__(self, values):
        self._values = tuple(values)

    @property
    def values(self) -> tuple:
        return self._values

    def __repr__(self):
        return f"PerWorkerValues({self._values!r})"


class PerWorkerDataset:
    """A dataset built on every worker by ``dataset_fn`` (``create_per_worker_dataset``).

    ``element_spec`` is the structure of one element, found by building the
    dataset once on the coordinator, as TF traces the dataset function there.
    The function travels to the workers pickled once here, so that one that
    does not pickle is refused at once rather than when a worker first needs it.
    """

    def __init__(self, coordinator, dataset_fn, element_spec):
        self._coordinator = coordinator
        self.dataset_fn = dataset_fn
        self.element_spec = element_spec
        self.dataset_id = new_resource_id("dataset")
        try:
            self.pickled_fn = cloudpickle.dumps(dataset_fn)
        except Exception as error:
            raise ValueError(
                "The per-worker dataset function goes to the workers pickled (cloudpickle), "
                f"and it does not pickle: {type(error).__name__}: {error}. Build what it "
                "captures inside the function instead (a lock, an open file...). "
                f"Received: dataset_fn={dataset_fn!r}"
            ) from error

    def __iter__(self):
        return PerWorkerIterator(self)

    def build(self, *args, **kwargs):
        """TF's ``build()``: the dataset is built on the workers when first used."""
        return self


class PerWorkerIterator:
    """An iterator over a ``PerWorkerDataset`` on every worker.

    Pass it to a scheduled function and call ``next()`` on it there. Calling
    ``next()`` on the coordinator raises: the data is on the workers.
    """

    def __init__(self, dataset: PerWorkerDataset):
        self.dataset = dataset
        self.iterator_id = new_resource_id("iterator")

    def __iter__(self):
        return self

    def __next__(self):
        raise ValueError(
            "A per-worker iterator's elements are on the workers: call `next()` on it inside "
            "a function given to `ClusterCoordinator.schedule`, passing the iterator as an "
            f"argument. Received: next() on the coordinator for {self!r}"
        )

    def __repr__(self):
        return f"<PerWorkerIterator {self.iterator_id} of {self.dataset.dataset_id}>"


class TracedIterator:
    """Stands for a per-worker iterator while a scheduled function is traced.

    Each ``next()`` returns the next group of traced inputs; how many were
    taken tells the worker how many elements to read.
    """

    def __init__(self, elements):
        self._elements = list(elements)
        self.taken = 0

    def __iter__(self):
        return self

    def __next__(self):
        if self.taken >= len(self._elements):
            self.taken += 1
            # A placeholder of the right structure: the trace is redone with
            # one more input per call once the count is known.
            return self._elements[0] if self._elements else None
        element = self._elements[self.taken]
        self.taken += 1
        return element

    def get_next(self):
        return next(self)


def element_spec_of(element):
    """``(treedef, [(shape, dtype)])`` of one dataset element."""
    leaves, treedef = jax.tree_util.tree_flatten(element)
    specs = []
    for leaf in leaves:
        array = np.asarray(leaf)
        specs.append((tuple(array.shape), array.dtype.name))
    return treedef, specs
