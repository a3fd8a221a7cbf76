"""Between-graph execution: a worker task runs its own programs, no coordinator.

In TF1's between-graph mode every worker runs the training program itself.
``LocalScheduler`` gives such a worker the coordinator's ``schedule``: the
function is traced into the same program a coordinator would send, and runs
here at once (read the variables from the ps tasks, run, send the writes
back), asynchronously with the other workers. The worker's local devices
run each step together, as synchronous replicas: the batch is split between
them and XLA all-reduces the gradients (``spread_over``).
"""

from keras_dist.parameter_server.rpc import _protocol as protocol
from keras_dist.parameter_server.scheduling._remote_value import RemoteValue
from keras_dist.parameter_server.tasks._worker_service import WorkerService


class LocalScheduler:
    """``schedule``/``join`` that run the program in this process, synchronously.

    Per-worker iterators are not supported here (there is no coordinator to
    create them): pass batches as arguments.
    """

    def __init__(self, strategy, worker_index: int):
        extended = strategy.extended
        self._programs = extended.programs
        self._index = worker_index
        name = f"/job:worker/replica:0/task:{worker_index}"
        self._service = WorkerService(
            name, extended.cluster_spec, extended.num_workers, devices=extended.step_devices
        )
        self._loaded: set = set()

    def schedule(self, fn, args=(), kwargs=None) -> RemoteValue:
        call = self._programs.call(fn, args, kwargs)
        if call.iterators:
            raise ValueError(
                "Per-worker iterators need a `ClusterCoordinator`; in between-graph mode "
                "(a worker running the program) pass each batch as an argument. "
                f"Received: {len(call.iterators)} per-worker iterator arguments"
            )
        program = call.program
        if program.program_id not in self._loaded:
            self._service.handle(program.header(), [], program.blob)
            self._loaded.add(program.program_id)
        header = protocol.request(
            protocol.RUN, program_id=program.program_id, worker_index=self._index, iterators=[]
        )
        _, results, _ = self._service.handle(header, call.arrays_for(self._index), b"")
        value = RemoteValue()
        value.set_value(program.results(results))
        return value

    def join(self, timeout=None) -> None:
        """Nothing to wait for: every function ran when it was scheduled."""
