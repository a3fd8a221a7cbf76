"""Summaries in TF 2's format, as ``tf.summary`` writes them for Keras's TensorBoard callback.

TF 2 writes every summary as a tensor with the plugin that reads it: a scalar is
a 0-d ``float32`` tensor of the ``scalars`` plugin, a histogram a ``(30, 3)``
``float64`` tensor of ``(left edge, right edge, count)`` rows of the
``histograms`` plugin, the model its JSON for the ``graph_keras_model`` plugin.
Tools written for TF 2's logs read these tensors (``EventAccumulator.Tensors``,
``tf.make_ndarray``); the protos are tensorboardX's, so no TensorFlow is needed.

>>> summary = scalar_summary("epoch_loss", 0.5)
>>> value = summary.value[0]
>>> value.metadata.plugin_data.plugin_name, np.frombuffer(value.tensor.tensor_content, "<f4")
('scalars', array([0.5], dtype=float32))
"""

import os
import time

import numpy as np
from tensorboardX.event_file_writer import EventsWriter
from tensorboardX.proto import event_pb2
from tensorboardX.proto import summary_pb2
from tensorboardX.proto import tensor_pb2
from tensorboardX.proto import tensor_shape_pb2
from tensorboardX.proto import types_pb2

HISTOGRAM_BUCKETS = 30  # tf.summary.histogram's default


def scalar_summary(tag: str, value) -> summary_pb2.Summary:
    """A scalar as ``tf.summary.scalar`` writes it: a ``float32`` 0-d tensor."""
    return _tensor_summary(tag, np.asarray(value, "<f4"), types_pb2.DT_FLOAT, "scalars")


def histogram_summary(tag: str, values, buckets: int = HISTOGRAM_BUCKETS) -> summary_pb2.Summary:
    """Values as ``tf.summary.histogram`` writes them: ``buckets`` rows of (left, right, count).

    The buckets split ``[min, max]`` evenly (the last one closed); all-equal
    values give every bucket that value as both edges and the last one the count.
    """
    rows = histogram_bucket_rows(values, buckets)
    return _tensor_summary(tag, rows.astype("<f8"), types_pb2.DT_DOUBLE, "histograms")


def histogram_bucket_rows(values, buckets: int = HISTOGRAM_BUCKETS) -> np.ndarray:
    """The ``(buckets, 3)`` array of a histogram summary (TensorBoard's v2 buckets).

    >>> histogram_bucket_rows(np.array([0.0, 1.0, 1.0, 3.0]), buckets=3).tolist()
    [[0.0, 1.0, 1.0], [1.0, 2.0, 2.0], [2.0, 3.0, 1.0]]
    """
    data = np.asarray(values, dtype=np.float64).ravel()
    if data.size == 0:
        return np.zeros((buckets, 3))
    low, high = data.min(), data.max()
    if low == high:
        counts = np.zeros(buckets)
        counts[-1] = data.size
        return np.stack([np.full(buckets, low), np.full(buckets, low), counts], axis=1)
    index = np.minimum(np.floor((data - low) / ((high - low) / buckets)).astype(int), buckets - 1)
    counts = np.bincount(index, minlength=buckets).astype(np.float64)
    edges = np.linspace(low, high, buckets + 1)
    return np.stack([edges[:-1], edges[1:], counts], axis=1)


def keras_model_summary(tag: str, model) -> "summary_pb2.Summary | None":
    """The model's JSON config, which TensorBoard's graph tab draws; ``None`` if it has none."""
    try:
        config = model.to_json()
    except Exception:  # as Keras: a model that cannot be serialized is not drawn
        return None
    tensor = tensor_pb2.TensorProto(
        dtype=types_pb2.DT_STRING,
        tensor_shape=_shape((1,)),
        string_val=[config.encode("utf-8")],
    )
    return _summary(tag, tensor, "graph_keras_model", content=b"1")


class EventFile:
    """One run's event file, as ``tf.summary``'s writer names and fills it.

    Written in the caller's thread: tensorboardX's ``FileWriter`` hands events to
    a thread and a multiprocessing queue of its own, which outlive a ``fit``
    that raises unless closed, and whose feeder thread ends some time after
    ``close`` returns. Here ``close`` leaves nothing running and no file open.
    """

    def __init__(self, run_dir: str):
        os.makedirs(run_dir, exist_ok=True)
        self._events = EventsWriter(os.path.join(run_dir, "events"))
        self.closed = False

    def add_summary(self, summary: summary_pb2.Summary, global_step: int) -> None:
        event = event_pb2.Event(summary=summary, step=int(global_step), wall_time=time.time())
        self._events.write_event(event)

    def flush(self) -> None:
        self._events.flush()

    def close(self) -> None:
        """Flushes and closes the file; safe to repeat."""
        if not self.closed:
            self.closed = True
            self._events.close()


def _tensor_summary(tag, array, dtype, plugin):
    tensor = tensor_pb2.TensorProto(
        dtype=dtype, tensor_shape=_shape(array.shape), tensor_content=array.tobytes()
    )
    return _summary(tag, tensor, plugin)


def _shape(shape):
    return tensor_shape_pb2.TensorShapeProto(
        dim=[tensor_shape_pb2.TensorShapeProto.Dim(size=size) for size in shape]
    )


def _summary(tag, tensor, plugin, content=b""):
    metadata = summary_pb2.SummaryMetadata(
        plugin_data=summary_pb2.SummaryMetadata.PluginData(plugin_name=plugin, content=content)
    )
    return summary_pb2.Summary(
        value=[summary_pb2.Summary.Value(tag=tag, metadata=metadata, tensor=tensor)]
    )
