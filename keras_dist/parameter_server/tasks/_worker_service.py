"""The worker's side: runs the programs the coordinator sends, on this task's devices.

A worker keeps the programs (``jax.export`` blobs), per-worker datasets and
iterators the coordinator created on it. ``run`` reads the variables a program
uses from the ps tasks, feeds it the iterators' next elements, and sends its
writes back: one request per ps task each way. After a restart the worker has
none of these; it answers ``NotFoundError`` and the coordinator sends them
again. Dataset functions arrive pickled (cloudpickle) and are unpickled only
in an authenticated call.
"""

import inspect
import threading

import cloudpickle
import jax
import numpy as np
from jax.sharding import Mesh
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec

from keras_dist import errors
from keras_dist._input import InputContext
from keras_dist.parameter_server.rpc import _protocol as protocol
from keras_dist.parameter_server.rpc._transport import error_header
from keras_dist.parameter_server.variables._client import Location
from keras_dist.parameter_server.variables._client import ParameterServers
from keras_dist.parameter_server.variables._trace import on_worker


class _LoadedProgram:
    def __init__(self, header, blob):
        exported = jax.export.deserialize(bytearray(blob))
        self.call = jax.jit(exported.call)
        self.locations = [Location.from_json(x) for x in header["variables"]]
        # The ps tasks holding its variables: whose versions decide if saved values are current.
        self.ps_tasks = sorted({s.task for location in self.locations for s in location.shards})
        self.writes = [(index, kind) for index, kind in header["writes"]]
        self.n_results = header["n_results"]
        self.updates = [tuple(u) for u in header.get("updates", ())]

    def split_outputs(self, outputs):
        """``(results, writes, updates)`` from the program's outputs, for ``servers.update``."""
        results = outputs[: self.n_results]
        position = self.n_results + len(self.writes)
        payloads = outputs[self.n_results : position]
        writes = [
            (self.locations[index], kind, payload)
            for (index, kind), payload in zip(self.writes, payloads)
        ]
        updates = []
        for task, update_id, count in self.updates:
            updates.append((task, update_id, outputs[position : position + count]))
            position += count
        return results, writes, updates


def spread_over(mesh, inputs, batch_inputs: range) -> list:
    """``inputs`` placed on ``mesh``'s devices: ``batch_inputs`` split along axis 0.

    An input whose first axis the devices divide is split (each device takes
    its rows); the rest (variable values, the worker index, a ragged batch)
    is copied to every device. XLA then runs the program as synchronous
    replicas on the devices and all-reduces what the rows contribute to, the
    gradients, so the step's numbers are the one-device step's.
    """
    split = NamedSharding(mesh, PartitionSpec("replica"))
    copied = NamedSharding(mesh, PartitionSpec())
    placed = []
    for i, x in enumerate(inputs):
        splits = i in batch_inputs and np.ndim(x) >= 1 and np.shape(x)[0] % mesh.size == 0
        placed.append(jax.device_put(x, split if splits else copied))
    return placed


class WorkerService:
    """Answers the coordinator's requests on one worker task.

    Given several ``devices`` (a between-graph worker's local devices), each
    program runs on all of them, its batch split between them (``spread_over``).
    """

    def __init__(
        self, task_name: str, cluster_spec, num_workers: int, credentials=None, devices=()
    ):
        self.task_name = task_name
        self.servers = ParameterServers(cluster_spec, credentials)
        self._mesh = Mesh(np.array(devices), ("replica",)) if len(devices) > 1 else None
        self._num_workers = num_workers
        self._programs: dict = {}
        self._datasets: dict = {}
        self._iterators: dict = {}
        # Location -> (epoch, ps versions, value) from this worker's last update.
        self._cache: dict = {}
        self._lock = threading.Lock()
        self._run_lock = threading.Lock()
        self.runs = 0

    @property
    def num_devices(self) -> int:
        """How many devices each step runs on."""
        return 1 if self._mesh is None else self._mesh.size

    @property
    def loaded_programs(self) -> list:
        """The ids of the programs this worker holds (the coordinator's live ones)."""
        with self._lock:
            return sorted(self._programs)

    def handle(self, header: dict, arrays: list, blob: bytes):
        op = protocol.check_request(header, "worker")
        if op is protocol.PING:
            return {"task": self.task_name, "devices": self.num_devices}, [], b""
        if op is protocol.LOAD:
            program = _LoadedProgram(header, blob)
            with self._lock:
                self._programs[header["program_id"]] = program
            return {}, [], b""
        if op is protocol.DATASET:
            return self._create_dataset(header, blob)
        if op is protocol.ITERATOR:
            dataset = self._lookup(self._datasets, header["dataset_id"], "dataset")
            with self._lock:
                # Two runs may be in flight on a worker: one reader at a time.
                self._iterators[header["iterator_id"]] = (iter(dataset), threading.Lock())
            return {}, [], b""
        if op is protocol.RUN:
            return self._run(header, arrays)
        if op is protocol.RUN_MANY:
            return self._run_many(header, arrays)
        raise AssertionError(f"`{op.name}` is in the protocol and not served here")

    def _lookup(self, table, key, what):
        with self._lock:
            try:
                return table[key]
            except KeyError:
                raise errors.NotFoundError(
                    f"{self.task_name} has no {what} {key!r} (it restarted); the coordinator "
                    f"sends it again. Received: {what}={key!r}",
                    (self.task_name,),
                ) from None

    def _create_dataset(self, header, blob):
        worker_index = header["worker_index"]
        dataset_fn = cloudpickle.loads(blob)
        context = InputContext(self._num_workers, worker_index, 1)
        with on_worker(worker_index):
            dataset = _call_dataset_fn(dataset_fn, context)
            # A strategy's distributed dataset (``DirectDataset``) is built here.
            build = getattr(dataset, "dataset_for", None)
            if callable(build):
                dataset = build(context)
        with self._lock:
            self._datasets[header["dataset_id"]] = dataset
        return {}, [], b""

    def _run(self, header, arrays):
        # One run at a time (as TF's worker runs its closures), each from the
        # values the previous one left, even if a caller sends two at once.
        with self._run_lock:
            return self._run_now(header, arrays)

    def _run_many(self, header, arrays):
        """Runs several calls one after the other (one request: one round trip for all).

        Stops at the first that fails: the reply has the results of those
        that ran (``done``) and the failure's error fields under ``failed``.
        """
        self._unload(header.get("unload", ()))
        results, counts, position, failed = [], [], 0, None
        versions: dict = {}  # ps task -> its newest version these calls' updates left
        for call in header["calls"]:
            arguments = arrays[position : position + call["n_arrays"]]
            position += call["n_arrays"]
            try:
                reply, outputs, _ = self._run(call, arguments)
            except Exception as error:  # noqa: BLE001 - sent back, raised for this call there
                failed = error_header(error)
                break
            for task, version in reply.get("versions", ()):
                versions[task] = max(version, versions.get(task, version))
            results += outputs
            counts.append(len(outputs))
        reply = {"done": len(counts), "counts": counts, "failed": failed}
        return dict(reply, versions=sorted(versions.items())), results, b""

    def _unload(self, program_ids) -> None:
        """Drops freed programs, and the values cached for variables no program uses."""
        if not program_ids:
            return
        with self._lock:
            for program_id in program_ids:
                self._programs.pop(program_id, None)
            used = {location for p in self._programs.values() for location in p.locations}
            # A freed model's variables (its weights, MiBs) would stay here otherwise.
            self._cache = {k: v for k, v in self._cache.items() if k in used}

    def _run_now(self, header, arrays):
        program = self._lookup(self._programs, header["program_id"], "program")
        epoch = header.get("epoch")
        fresh = dict(header.get("fresh", ()))
        inputs = self._variable_values(program, epoch, fresh) + list(arrays)
        for iterator_id, count in header["iterators"]:
            iterator, reading = self._lookup(self._iterators, iterator_id, "iterator")
            for _ in range(count):
                try:
                    with reading:
                        element = next(iterator)
                except StopIteration:
                    raise errors.OutOfRangeError(
                        f"The per-worker dataset of iterator {iterator_id} on {self.task_name} "
                        "is exhausted. Make the dataset repeat, or schedule fewer steps. "
                        "Received: StopIteration from next()"
                    ) from None
                inputs += [np.asarray(x) for x in jax.tree_util.tree_leaves(element)]
        inputs.append(np.int32(header["worker_index"]))
        if self._mesh is not None:
            # Every input but the variables' values and the worker index is data.
            batch_inputs = range(len(program.locations), len(inputs) - 1)
            inputs = spread_over(self._mesh, inputs, batch_inputs)
        try:
            outputs = [np.asarray(x) for x in program.call(*inputs)]
        except (TypeError, ValueError) as error:
            # The program was traced on the coordinator for other dtypes or
            # shapes (any batch size, unless the function needs it as a number).
            raise errors.InvalidArgumentError(
                f"{self.task_name} cannot run the scheduled function on these inputs: they "
                "differ from those it was traced for. Give every element the same structure, "
                "dtypes and shapes but for the batch size (and the same batch size too if "
                f"the function uses it as a number: drop the remainder). Received: {error}",
                (self.task_name,),
            ) from None
        results, writes, updates = program.split_outputs(outputs)
        versions: dict = {}
        if writes or updates:
            # The same requests bring the values back (one round trip per ps
            # task): the next run of this epoch starts from them, unless the
            # coordinator has seen a newer version of a ps task since.
            read = program.locations if epoch is not None else ()
            values = self.servers.update(
                writes, read=read, updates=updates, run_id=header.get("run_id"), versions=versions
            )
            with self._lock:
                for location, value in zip(read, values):
                    self._cache[location] = (epoch, versions, value)
        self.runs += 1
        return {"versions": sorted(versions.items())}, results, b""

    def _variable_values(self, program, epoch, fresh: dict) -> list:
        """Values as of this worker's last step, where still current; else read from the ps.

        ``epoch`` changes whenever the coordinator joins or writes a variable,
        so a function scheduled after those reads afresh. Between them a worker
        starts from the values its previous step got back, unless a ps task
        has since reached a newer version in a call the coordinator saw finish
        (``fresh``: task -> version): a function scheduled after another's
        result was fetched sees its writes, as TF's, however long this worker
        was idle.
        """
        locations = program.locations
        if not locations:
            return []
        with self._lock:
            cached = [self._cache.get(location) for location in locations]
        if epoch is not None and all(c is not None and c[0] == epoch for c in cached):
            # One versions dict per update that filled the cache (usually the last
            # one): checked once each, not once a variable.
            stamps = {id(c[1]): c[1] for c in cached}.values()
            if all(_at_least(v, fresh, program.ps_tasks) for v in stamps):
                return [value for _, _, value in cached]
        return self.servers.read(locations)

    def close(self) -> None:
        self.servers.close()


def _at_least(versions: dict, fresh: dict, tasks) -> bool:
    """Whether values read at ``versions`` (ps task -> version) are at least ``fresh``'s
    versions on each of ``tasks``."""
    return all(versions.get(task, -1) >= fresh.get(task, -1) for task in tasks)


def _call_dataset_fn(dataset_fn, context):
    """``dataset_fn(input_context)``, or ``dataset_fn()`` when it takes no argument."""
    try:
        takes_context = bool(inspect.signature(dataset_fn).parameters)
    except (TypeError, ValueError):  # a builtin without a signature
        takes_context = True
    return dataset_fn(context) if takes_context else dataset_fn()
