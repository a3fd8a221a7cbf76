"""``tf.summary`` calls in a replica thread write where the caller's would, once per step.

TensorFlow keeps the default summary writer, step and recording condition per thread,
and Keras's ``TensorBoard`` callback sets them in the thread that runs ``fit``. The
eager engine runs each replica in a thread of its own, where a layer's
``tf.summary.scalar`` would find no writer and record nothing. TF's MirroredStrategy
hands the caller's state to its replica threads and records on replica 0 only (its
replica context turns recording off elsewhere); here replica 0's thread takes the
caller's state and the others get none: each summary is written once, as on one device.

Only where TensorFlow is already imported: keras_dist never imports it.

>>> print(caller_summary_state())  # no tf.summary writer is set in this thread
None
"""

import sys

_SUMMARY_OPS = "tensorflow.python.ops.summary_ops_v2"


def _thread_state():
    """TF's per-thread summary state object (the one its own replica threads copy)."""
    summary_ops = sys.modules.get(_SUMMARY_OPS)
    return getattr(summary_ops, "_summary_state", None)


def caller_summary_state():
    """The calling thread's ``tf.summary`` writer, step and condition; ``None`` when unset."""
    state = _thread_state()
    if state is None or state.writer is None:
        return None
    return state.writer, state.step, state.is_recording


def adopt_summary_state(saved) -> None:
    """Makes ``saved`` (from ``caller_summary_state``) this thread's summary state."""
    state = _thread_state()
    if saved is not None and state is not None:
        state.writer, state.step, state.is_recording = saved
