"""The program every task of test_cluster_managers.py runs, started by srun or mpirun.

    python cluster_manager_tasks.py mwms OUT_DIR [PORT_BASE]
    python cluster_manager_tasks.py ps OUT_DIR PORT_BASE

``mwms``: MultiWorkerMirroredStrategy ``fit`` of test_multi_worker.py's tiny model on its
data, from the fixed first weights below; with PORT_BASE the task builds
``SlurmClusterResolver(port_base=PORT_BASE)`` itself, else the strategy finds the cluster
(``resolve_cluster``). ``ps``: a parameter-server job of one chief, two workers and one ps
from ``SlurmClusterResolver``; the chief trains, the others serve until it ends.
Each task writes what the test checks to ``OUT_DIR/<rank>.json``.
"""

import json
import os
import sys

import numpy as np
from test_multi_worker import _flat
from test_multi_worker import _regression_data
from test_multi_worker import _tiny_model

import keras_dist as kd

# Nothing here uses JAX or Keras before MultiWorkerMirroredStrategy() has started JAX's
# multi-process runtime: test_multi_worker's helpers import Keras when called.

ROWS, BATCH, EPOCHS = 69, 16, 2  # 69 = 4 x 16 + 5: the last batch is split 3 / 2
PS_JOBS = {"ps": 1, "worker": 2, "chief": 1}
PS_STEPS = 3 * 8  # 3 epochs of 256 rows, batch 32


def fixed_weights(model) -> list:
    """The same first weights in every task and in the one-device reference."""
    rng = np.random.default_rng(7)
    return [rng.normal(scale=0.5, size=w.shape).astype("float32") for w in model.get_weights()]


def _rank() -> int:
    """This task's rank from the launcher (srun's or mpirun's), for its file name."""
    return int(os.environ.get("SLURM_PROCID") or os.environ["OMPI_COMM_WORLD_RANK"])


def _write(out_dir, result) -> None:
    path = os.path.join(out_dir, f"{_rank()}.json")
    with open(path + ".tmp", "w") as file:
        json.dump(result, file)
    os.replace(path + ".tmp", path)  # the test never reads half a file


def mwms(out_dir, port_base=None) -> None:
    resolver = None
    if port_base is not None:
        resolver = kd.cluster_resolver.SlurmClusterResolver(port_base=int(port_base))
    strategy = kd.MultiWorkerMirroredStrategy(resolver)  # first: it starts jax.distributed
    with strategy.scope():
        model = _tiny_model()
    model.set_weights(fixed_weights(model))
    x, y = _regression_data(ROWS)
    history = model.fit(x, y, batch_size=BATCH, epochs=EPOCHS, shuffle=False, verbose=0)
    resolver = strategy.cluster_resolver
    _write(
        out_dir,
        {
            "resolver": type(resolver).__name__,
            "task": [resolver.task_type, resolver.task_id],
            "cluster": resolver.cluster_spec().as_dict(),
            "replicas": strategy.num_replicas_in_sync,
            "final": _flat(model.get_weights()).tolist(),
            "history": history.history,
            "hnp_uri": os.environ.get("OMPI_MCA_orte_hnp_uri"),
        },
    )


def ps(out_dir, port_base) -> None:
    resolver = kd.cluster_resolver.SlurmClusterResolver(jobs=PS_JOBS, port_base=int(port_base))
    task = [resolver.task_type, resolver.task_id]
    if resolver.task_type == "worker":
        # Serves the chief's steps until the chief's program ends and tells it to stop.
        server = kd.Server(resolver)
        server.join()
        _write(out_dir, {"task": task, "runs": server.service.runs})
        return
    if resolver.task_type == "ps":
        try:
            kd.ParameterServerStrategy(resolver)  # serves here until the job ends
        except SystemExit as ended:
            _write(out_dir, {"task": task, "exit": ended.code})
            raise
        raise AssertionError("a ps task's ParameterServerStrategy() returned")
    _chief(out_dir, resolver, task)


def _chief(out_dir, resolver, task) -> None:
    import keras

    strategy = kd.ParameterServerStrategy(resolver)
    rng = np.random.default_rng(0)
    x = rng.normal(size=(256, 8)).astype("float32")
    y = (x @ rng.normal(size=(8, 1))).astype("float32")
    keras.utils.set_random_seed(0)
    with strategy.scope():
        model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(1)])
        model.compile(keras.optimizers.SGD(0.05), "mse")
    history = model.fit(x, y, batch_size=32, epochs=3, verbose=0)
    _write(
        out_dir,
        {
            "task": task,
            "cluster": resolver.cluster_spec().as_dict(),
            "iterations": int(model.optimizer.iterations.numpy()),
            "loss": history.history["loss"],
            "devices": sorted({v.device for v in model.trainable_variables}),
        },
    )
    # Returning ends the job: at exit this process tells the ps and worker servers to stop.


if __name__ == "__main__":
    {"mwms": mwms, "ps": ps}[sys.argv[1]](*sys.argv[2:])
