"""What an engine supplies: every method a frame's engine is called with, declared.

``strategy.run`` hands ``fn`` to an engine (compiled: one SPMD program per
input signature; eager: one thread per replica; uneven: the replicas traced one
by one into one program). While ``fn`` runs, every context frame names an engine
object, and ``ReplicaContext``, distributed variables and the strategy ask it
for what only the engine knows how to do:

* ``ReplicaEngine``: the replica side (collectives, ``merge_call``), for
  ``ReplicaContext``; every engine has one.
* ``TracedMerge``: the cross-replica side of a run whose values are traced
  (a ``merge_fn`` inside a compiled or uneven step), where a reduction is part
  of the program: the mesh strategy routes traced values here.
* ``ReplicaCopies``: a ``TracedMerge`` that holds every replica's copy of the
  variables (the uneven engine's), so SyncOnRead writes reach each copy.
"""

import abc


class ReplicaEngine(abc.ABC):
    """The replica side of one run: collectives and ``merge_call`` for ``ReplicaContext``.

    ``compiled`` says whether values are traced (one trace stands for every
    replica) or real (one thread per replica).
    """

    compiled: bool = False

    @abc.abstractmethod
    def merge_call(self, replica_context, merge_fn, args, kwargs):
        """Runs ``merge_fn(strategy, *args, **kwargs)`` once, in cross-replica context."""

    @abc.abstractmethod
    def all_reduce(self, reduce_op, value):
        """``value`` (a nest) reduced across replicas; every replica gets the result."""

    @abc.abstractmethod
    def all_gather(self, value, axis):
        """``value`` (a nest) of every replica, concatenated along ``axis``."""

    def primary_for(self, variable):
        """Replica 0's counterpart of a variable another replica creates, if any."""
        return None


class TracedMerge(abc.ABC):
    """The cross-replica side of a run whose values are traced: reductions join the program."""

    compiled = True

    @abc.abstractmethod
    def call_for_each_replica(self, fn, args, kwargs):
        """``strategy.run`` from a ``merge_fn``: the trace's replicas run ``fn``."""

    @abc.abstractmethod
    def reduce_traced(self, reduce_op, values) -> list:
        """``batch_reduce_to`` of traced values: one ``Mirrored`` result each."""

    @abc.abstractmethod
    def reduce_with_axis(self, reduce_op, value, axis):
        """``strategy.reduce`` of a traced per-replica value (``axis`` as there)."""

    @abc.abstractmethod
    def gather_traced(self, value, axis):
        """``strategy.gather`` of a traced per-replica value."""

    @abc.abstractmethod
    def update_component(self, variable, fn, args, kwargs):
        """``extended.update`` of a SyncOnRead variable with per-replica arguments."""

    @abc.abstractmethod
    def aggregate_sync_on_read(self, variable, local):
        """A SyncOnRead variable read in cross-replica code inside the run."""


class ReplicaCopies(TracedMerge):
    """A ``TracedMerge`` holding every replica's copy of the variables (not one, as SPMD)."""

    @abc.abstractmethod
    def sync_on_read_components(self, variable) -> tuple:
        """Every replica's component of a SyncOnRead variable, as traced here."""
