"""The replica engines behind ``strategy.run``.

* ``CompiledEngine``: ``jax.jit`` over ``jax.shard_map``, one program per input
  signature (the default).
* ``EagerEngine``: one thread per replica (``run_functions_eagerly`` debugging,
  and per-replica inputs of different shapes across processes).
* ``UnevenEngine``: per-replica inputs of different shapes (the last partial
  batch of a custom loop), compiled: the eager engine's threads, in one trace.
* ``LogicalDevicesEngine``: the compiled engine for replicas that span several
  devices (TF's logical devices), with the sharding constraints they use.
Each engine's replica side implements ``ReplicaEngine``; what the frames ask of an
engine is declared in ``keras_dist/_engine_contract.py``. (Keras's steps compiled
per replica shape, for ``fit``'s uneven batches, are ``_keras_steps/_per_shape_steps.py``.)
"""

from keras_dist._engine._compiled import CompiledEngine as CompiledEngine
from keras_dist._engine._compiled import ReplicatedOutput as ReplicatedOutput
from keras_dist._engine._eager import EagerEngine as EagerEngine
from keras_dist._engine._function import Function as Function
from keras_dist._engine._function import function as function
from keras_dist._engine._inline import run_inline as run_inline
from keras_dist._engine._logical import LogicalDevicesEngine as LogicalDevicesEngine
from keras_dist._engine._repeat_call import MISSED as MISSED
from keras_dist._engine._uneven import UnevenEngine as UnevenEngine
from keras_dist._engine_contract import ReplicaEngine as ReplicaEngine
