"""The ``ClusterResolver`` base class and the helpers its subclasses share.

As in ``tf.distribute.cluster_resolver``: a resolver gives a ``ClusterSpec``,
this task's ``task_type`` and ``task_id``, and the master address. The
resolvers of each environment live in their own modules beside this one.
"""

import abc
import collections
import re

import jax


def format_master_url(master, rpc_layer=None):
    return f"{rpc_layer}://{master}" if rpc_layer else master


_DEVICE_NAME = re.compile(r"/job:([^/]+)/(?:replica:\d+/)?task:(\d+)/device:([^:]+):\d+$")


class ClusterResolver(abc.ABC):
    """Abstract base of cluster resolvers (``tf.distribute.cluster_resolver.ClusterResolver``).

    Subclasses implement ``cluster_spec()`` and ``master()``. ``task_type``,
    ``task_id`` and ``rpc_layer`` may be set after construction.

    >>> from keras_dist.cluster_resolver import ClusterSpec
    >>> class Fixed(ClusterResolver):
    ...     def cluster_spec(self):
    ...         return ClusterSpec({"worker": ["w0:2222"]})
    ...     def master(self, task_type=None, task_id=None, rpc_layer=None):
    ...         return ""
    >>> Fixed().cluster_spec().jobs, Fixed().environment
    (['worker'], '')
    """

    task_type = None
    task_id = None
    rpc_layer = None

    @abc.abstractmethod
    def cluster_spec(self):
        """The ``ClusterSpec`` of the whole cluster."""

    @abc.abstractmethod
    def master(self, task_type=None, task_id=None, rpc_layer=None):
        """The address of a task (this one by default), prefixed by ``rpc_layer://``."""

    def task_master(self, task_type, task_id, rpc_layer) -> str:
        """``rpc_layer://address`` of a task of ``cluster_spec()``; ``""`` without a task."""
        if task_type is None or task_id is None:
            return ""
        address = self.cluster_spec().task_address(task_type, task_id)
        return format_master_url(address, rpc_layer)

    @property
    def environment(self):
        """The environment the cluster runs in: ``""`` or, as in TF, ``"google"``."""
        return ""

    def _device_names(self):
        # TF-style names of this process's devices; tests replace this to list a cluster.
        job = self.task_type or "localhost"
        task = self.task_id or 0
        return [
            f"/job:{job}/replica:0/task:{task}/device:{d.platform.upper()}:{i}"
            for i, d in enumerate(jax.local_devices())
        ]

    def num_accelerators(self, task_type=None, task_id=None, config_proto=None):
        """Counts accelerators (not CPUs) by type, e.g. ``{"GPU": 2}``.

        With ``task_type`` and ``task_id``, only that task's devices count.
        ``config_proto`` is accepted for TF compatibility and ignored.
        """
        del config_proto  # TF session configuration; there is none under JAX.
        counts = collections.defaultdict(int)
        for name in self._device_names():
            match = _DEVICE_NAME.search(name)
            if match is None:
                continue
            job, task, device_type = match.group(1), int(match.group(2)), match.group(3)
            if device_type == "CPU":
                continue
            if task_type is not None and task_id is not None:
                if job != task_type or task != int(task_id):
                    continue
            counts[device_type] += 1
        return dict(counts)
