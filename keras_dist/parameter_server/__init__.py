"""The parameter-server wing: everything ``ParameterServerStrategy`` runs on, in one place.

The strategy itself is ``strategies/_parameter_server.py`` (one file per public
strategy); its public faces are ``kd.coordinator``, ``kd.experimental.partitioners``,
``kd.Server`` and ``kd.testing.create_in_process_cluster``. The pieces, as a
request travels (see ``docs/architecture.md``, "Parameter servers"):

* ``_fit``, ``_data``: Keras's ``fit``/``evaluate``/``predict`` as scheduled
  steps, and the data they read (``DatasetCreator``).
* ``variables/``: ``PSVariable`` (a Keras variable whose value is on the ps
  tasks), ``ShardedVariable``, partitioners, and the client of the ps tasks.
* ``scheduling/``: the coordinator's side: a function traced into a program
  (``_trace``, ``_program_cache``), optimizer updates traced for the ps tasks
  (``_update_tracing``), ``ClusterCoordinator`` with its queue and one thread
  per worker, per-worker values and remote values, between-graph workers.
* ``rpc/``: the protocol (every request's fields, checked), the bytes on the
  wire, the cluster token, the gRPC transport.
* ``tasks/``: what runs in a ps or worker task: ``kd.Server``, the variable
  store, loaded updates, the worker service.
* ``_job``: when a launched job with ps tasks ends, and the token its tasks share.

The package's ``__init__`` files import nothing: a ps task loads only what it
serves.
"""
