"""State threading: Keras's ``StatelessScope`` maps variables to values.

The compiled engine and ``value_and_grad`` run user code with every variable's
value substituted by a traced one, the mechanism Keras itself uses for its
stateless calls. ``RecordingScope`` also records which variables were
assigned, and which were read without a mapping (created outside the state the
engine threads).
"""

from keras_dist._keras._internals import StatelessScope
from keras_dist._keras._internals import get_stateless_scope
from keras_dist._keras._internals import global_state
from keras_dist._keras._internals import initialize_all_variables


class RecordingScope(StatelessScope):
    """A ``StatelessScope`` that records assigned and unmapped variables.

    ``mapping`` is a dict ``id(variable) -> value``, taken as is (no copies or
    checks: this runs on every trace and every gradient call).

    >>> import keras
    >>> v = keras.Variable(1.0)
    >>> with RecordingScope({id(v): 2.0}) as scope:
    ...     _ = v.assign(3.0)
    >>> float(scope.state_mapping[id(v)]), list(scope.assigned) == [id(v)]
    (3.0, True)
    """

    def __init__(self, mapping: dict, deferred_writes: "list | None" = None, parent=None):
        # Losses a layer adds in its call (``add_loss``, activity regularizers) are kept
        # in the scope, so ``model.losses`` inside a replica function or a loss given to
        # ``value_and_grad`` holds them, as it does eagerly (TF's tape sees them too).
        super().__init__(collect_losses=True, initialize_variables=False)
        self.state_mapping = mapping
        self.assigned: dict = {}
        self.unmapped: dict = {}
        # When a list, distributed variables written in a replica append
        # (variable, kind, value) to it instead of aggregating at once.
        self.deferred_writes = deferred_writes
        # The scope this one is nested in: a variable this one does not map is read
        # there (so an enclosing trace finds it, instead of a constant of its value).
        self._parent = parent

    def add_update(self, update):
        variable, value = update
        self.assigned[id(variable)] = variable
        self.state_mapping[id(variable)] = value

    def get_current_value(self, variable):
        value = self.state_mapping.get(id(variable))
        if value is None:
            self.unmapped[id(variable)] = variable
            if self._parent is not None:
                value = self._parent.get_current_value(variable)
        return value


def current_scope():
    """The innermost stateless scope, or ``None``."""
    return get_stateless_scope()


def current_mapping() -> dict:
    """The ``id -> value`` mapping of the current stateless scope, if any."""
    scope = get_stateless_scope()
    return dict(scope.state_mapping) if scope is not None else {}


def pending_variables() -> list:
    """Variables created inside a stateless scope and not yet initialized."""
    return list(global_state.get_global_attribute("uninitialized_variables") or [])


def move_pending_variables(into: list) -> None:
    """Moves this thread's pending variables into ``into`` (Keras keeps them per thread).

    A replica thread of the uneven engine creates variables in its own stateless
    scope; the thread that initializes them takes them over with ``adopt_pending_variables``.
    """
    into.extend(pending_variables())
    global_state.set_global_attribute("uninitialized_variables", [])


def adopt_pending_variables(variables: list) -> None:
    """Makes ``variables`` pending on this thread, to be initialized here."""
    pending = global_state.get_global_attribute("uninitialized_variables", [], set_to_default=True)
    pending.extend(variables)


def initialize_pending_variables() -> None:
    """Gives the variables created in a stateless scope their first values."""
    initialize_all_variables()
