"""Which process writes the callbacks' files, asked once per ``fit``.

Every process of a multi-worker job runs the same ``fit`` and the same
callbacks. Saving reads the variables, and reading a variable may be a
collective across processes, so every process saves; the model's strategy
says where (``extended.role``, see ``cluster_resolver._role``).
"""

from keras_dist import _context
from keras_dist._keras_steps import model_strategy
from keras_dist.cluster_resolver._role import ProcessRole
from keras_dist.cluster_resolver._role import role_from_resolver

__all__ = ["ProcessRole", "process_role", "role_of_strategy"]


def role_of_strategy(strategy) -> ProcessRole:
    """The role the cluster resolver of ``strategy`` gives this process (chief without one).

    >>> import keras_dist as kd
    >>> role_of_strategy(kd.MultiWorkerMirroredStrategy()).is_chief
    True
    """
    return role_from_resolver(strategy.cluster_resolver)


def process_role(model) -> ProcessRole:
    """The role of this process for ``model``'s strategy (else the current strategy).

    The callbacks ask this function (through the module, so tests can replace
    it) once per ``fit``.

    >>> process_role(None).is_chief
    True
    """
    strategy = model_strategy(model) if model is not None else None
    strategy = strategy if strategy is not None else _context.get_strategy()
    return strategy.extended.role
