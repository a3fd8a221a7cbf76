"""The parameter-server benchmark's workload (an MLP, its values, each worker's data) and timing.

NumPy only: ``parameter_server.py`` (keras_dist and the raw-gRPC baseline) and
``_tf_parameter_server.py`` (TensorFlow, in a Python of its own) train the same thing.

>>> [p.shape for p in init_params()][:2]
[(784, 512), (512,)]
>>> [a.shape for a in batches(0, count=2)]
[(2, 64, 784), (2, 64)]
"""

import time

import numpy as np

SIZES = (784, 512, 512, 10)
BATCH, LR = 64, 0.01


def shapes():
    """The kernel and bias shapes of the MLP's layers, in order."""
    result = []
    for n_in, n_out in zip(SIZES[:-1], SIZES[1:]):
        result += [(n_in, n_out), (n_out,)]
    return result


def init_params(seed=0):
    """The MLP's first values (the same in every process for one ``seed``)."""
    rng = np.random.default_rng(seed)
    return [(rng.normal(size=s) * 0.05).astype("float32") for s in shapes()]


def batches(seed, count=16):
    """``count`` batches of inputs and integer labels; worker ``i`` uses ``seed=i``."""
    rng = np.random.default_rng(seed)
    xs = rng.normal(size=(count, BATCH, SIZES[0])).astype("float32")
    ys = rng.integers(0, SIZES[-1], size=(count, BATCH)).astype("int32")
    return xs, ys


def scheduled_rates(coordinator, step_fn, iterator, workers, steps, repeats, per_function=1):
    """Steps/s of ``repeats`` rounds of ``steps`` steps, after 4 warm-up functions per worker.

    ``step_fn`` runs ``per_function`` steps each time it is scheduled. The same for
    keras_dist's and TF's ``ClusterCoordinator`` (their ``schedule``/``join``).
    """
    for _ in range(4 * workers):  # trace, send and compile on every worker
        coordinator.schedule(step_fn, args=(iterator,))
    coordinator.join()
    rates = []
    calls = max(1, steps // per_function)
    for _ in range(repeats):
        began = time.perf_counter()
        for _ in range(calls):
            coordinator.schedule(step_fn, args=(iterator,))
        coordinator.join()
        rates.append(calls * per_function / (time.perf_counter() - began))
    return rates
