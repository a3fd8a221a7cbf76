"""Nothing a dropped model used stays behind under ParameterServerStrategy.

Building, fitting and deleting models on one strategy must free each model (the
strategy keeps its steps per model, weakly), its variables on the ps tasks, and the
programs its steps loaded on the workers.
"""

import gc
import re
import threading
import time

import jax
import keras
import numpy as np

import keras_dist as kd
from keras_dist.parameter_server._fit import ParameterServerSteps
from keras_dist.parameter_server.variables._ps_variable import PSVariable
from keras_dist.testing._ps_cluster import in_process_servers


def _count(cls) -> int:
    return sum(isinstance(o, cls) for o in gc.get_objects())


def _keys_once_freed(store, deadline=10.0) -> int:
    """The ps store's keys once the client's freeing thread has sent its deletes."""
    end = time.monotonic() + deadline
    while store.keys() and time.monotonic() < end:
        time.sleep(0.05)
    return len(store.keys())


def _thread_kinds() -> tuple:
    """``(threads outside pools, pools)``: a pool's threads are named ``prefix_N``.

    A pool starts its threads as work arrives, up to its own limit: sooner on a
    loaded machine, so their number is no measure of a leak. A leak is a thread,
    or a pool, that each round adds.
    """
    names = [t.name for t in threading.enumerate()]
    pooled = [name for name in names if re.search(r"_\d+$", name)]
    return len(names) - len(pooled), len({re.sub(r"_\d+$", "", name) for name in pooled})


def test_build_fit_delete_rounds_keep_models_ps_keys_and_worker_programs_flat():
    resolver = kd.testing.create_in_process_cluster(num_workers=1, num_ps=1)
    strategy = kd.ParameterServerStrategy(resolver)
    addresses = set(
        resolver.cluster_spec().job_tasks("ps") + resolver.cluster_spec().job_tasks("worker")
    )
    servers = [s for s in in_process_servers() if s.target.split("//")[-1] in addresses]
    ps = next(s for s in servers if s.job_name == "ps").service
    worker = next(s for s in servers if s.job_name == "worker").service
    rng = np.random.default_rng(0)
    x, y = rng.random((64, 8), dtype=np.float32), rng.integers(0, 3, 64)
    rounds, thread_names = [], []
    for _ in range(8):
        with strategy.scope():
            model = keras.Sequential(
                [
                    keras.Input((8,)),
                    keras.layers.Dense(16, activation="relu"),
                    keras.layers.Dense(3),
                ]
            )
            model.compile(
                "adam",
                keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                metrics=["accuracy"],
            )
        history = model.fit(x, y, batch_size=16, epochs=1, verbose=0)
        assert np.isfinite(history.history["loss"][0])
        held_keys = len(ps.keys())
        del model, history
        gc.collect()
        rounds.append(
            (
                _count(ParameterServerSteps),
                _count(PSVariable),
                _keys_once_freed(ps),
                len(worker.loaded_programs),
                len(strategy.extended.programs.dropped),
                len(jax.live_arrays()),
                _thread_kinds(),
            )
        )
        thread_names.append({t.name for t in threading.enumerate()})
    assert held_keys > 0  # a live model's variables were on the ps
    steps, variables, keys, programs, dropped, arrays, threads = zip(*rounds)
    assert set(steps) == {0} and set(variables) == {0} and set(keys) == {0}, rounds
    # The last round's program is freed with its model and dropped at the next request.
    assert max(programs) <= 1, rounds
    # The coordinator forgets a freed program once no worker holds it.
    assert max(dropped) <= 1, rounds
    assert max(arrays[2:]) <= 1.2 * max(arrays[1], 1), rounds
    # A thread or a pool kept per round would add 6 over these rounds.
    started = sorted(thread_names[-1] - thread_names[1])
    (lone_first, pools_first), (lone_last, pools_last) = threads[1], threads[-1]
    assert lone_last - lone_first <= 1 and pools_last == pools_first, (rounds, started)
