"""Errors of a distributed run, named as TensorFlow names them (``tf.errors``).

A multi-worker job that loses a peer raises ``UnavailableError`` (the peer
died) or ``DeadlineExceededError`` (the peer stopped answering), each naming
the task, so a user's ``except tf.errors.UnavailableError`` ports unchanged.

>>> import keras_dist as kd
>>> issubclass(kd.errors.UnavailableError, kd.errors.OpError)
True
"""


class OpError(RuntimeError):
    """A distributed operation failed. ``lost_tasks`` names the tasks involved."""

    def __init__(self, message, lost_tasks=()):
        super().__init__(message)
        self.message = message
        self.lost_tasks = tuple(lost_tasks)


class UnavailableError(OpError):
    """A peer of a collective is gone (its process died or its connection closed)."""


class DeadlineExceededError(OpError):
    """A collective did not complete within the configured timeout (a stuck peer)."""


__all__ = ["DeadlineExceededError", "OpError", "UnavailableError"]
