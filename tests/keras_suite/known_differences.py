"""Keras tests whose result under a strategy rightly differs from plain Keras.

Reviewed like code: every entry names the strategies it applies to and why the difference
is right (the test asserts something a strategy changes on purpose). A bug never goes here;
``run.py`` fails when an entry passes again, so the list stays short and true.
"""

_BOTH = ("mirrored", "one_device")
_MESH = (*_BOTH, "multi_worker_mirrored")
_ALL = (*_MESH, "parameter_server")

_LAST_BATCH_INDEX = (
    "Keras 3 reports `begin + steps_per_execution - 1` to `on_train_batch_end` for an epoch's "
    "last execution even past the data (batch 8 of a 7-batch epoch). keras_dist reports the "
    "epoch's last batch, as tf-keras does (TF's test_host_training_loop: "
    "steps_per_execution=20 on 50 batches ends at batch 49)."
)
_EPOCH_OF_STEPS_PER_EPOCH = (
    "With steps_per_epoch=5 and steps_per_execution=2, Keras 3 runs whole executions: 6 "
    "steps in the first epoch (reading into the second epoch's data), 4 in the second, and "
    "it counts 5 executions. keras_dist runs each epoch's 5 steps, its last execution a "
    "single step, as tf-keras does (TF's test_host_training_loop_dataset_unknown_size: "
    "steps_per_epoch=50, steps_per_execution=20 runs executions of 20, 20 and 10 steps "
    "each epoch, ending at batch 49): 6 executions over the 2 epochs."
)

_PS_ASYNCHRONOUS = (
    "Two workers run steps at once on weights read before the other's update "
    "(asynchronous training, as TF's parameter servers); with one worker "
    "(KERAS_DIST_SUITE_PS_WORKERS=1) it passes."
)
_PS_PROGRAM_TRACES = (
    "Under ParameterServerStrategy an execution's 20 steps are one program sent to the "
    "workers, unrolled (20 traces a pass), built once and reused for every execution: "
    "traced to find the variables it reads and writes on the ps tasks (and, for a "
    "`train_step` whose later steps read what earlier ones updated, again to run every "
    "update on the worker), then exported (`jax.export`): 40 to 60 traces, once."
)

KNOWN_DIFFERENCES: dict[str, tuple[tuple[str, ...], str]] = {
    **{
        f"trainers/trainer_test.py::TestTrainer::test_steps_per_execution_steps_count_{n}_{mode}": (
            _ALL,
            _LAST_BATCH_INDEX,
        )
        for n in (3, 101)
        for mode in ("eager", "jit", "non_jit")
    },
    **{
        "trainers/trainer_test.py::TestTrainer::"
        f"test_steps_per_execution_steps_per_epoch_match_multi_epoch_{mode}": (
            _ALL,
            _EPOCH_OF_STEPS_PER_EPOCH,
        )
        for mode in ("eager", "jit", "non_jit")
    },
    "trainers/trainer_test.py::TestTrainer::test_fit_eval_flow_for_jax_model_weights": (
        _ALL,
        "It asserts that Keras's JAX trainer empties every variable (`v._value is None`) "
        "during `fit`, Keras's hand-off of the state to its jitted loop. Under a strategy the "
        "variables keep their distributed values between steps: callbacks, checkpoints and "
        "the other workers read them there (under ParameterServerStrategy, on the ps tasks).",
    ),
    "trainers/trainer_test.py::TestTrainer::test_retracing": (
        ("mirrored", "multi_worker_mirrored", "parameter_server"),
        "It counts Python traces of `train_step` (at most 2), with steps_per_execution=20 "
        "and batches of 1 row. Under MirroredStrategy(4) (or 2 workers of 2 devices) each "
        "batch leaves 3 replicas "
        "empty: each replica's step is traced at its own shape (1 row, 0 rows) into one "
        "program (4 traces), compiled once and reused for every execution. " + _PS_PROGRAM_TRACES,
    ),
    "trainers/trainer_test.py::TestTrainer::test_retracing_predict": (
        ("parameter_server",),
        "It counts Python traces of `predict_step` (at most 2), with steps_per_execution=20. "
        + _PS_PROGRAM_TRACES,
    ),
    **{
        f"trainers/trainer_test.py::TestTrainer::test_fit_with_data_adapter_py_dataset{case}": (
            ("multi_worker_mirrored",),
            "Its PyDataset makes each batch under `keras.device('cpu:0')`. On JAX a device "
            "id is global across processes: 'cpu:0' is worker 0's first device, so worker 1 "
            "gets batches it cannot read ('Fetching value for `jax.Array` that spans "
            "non-addressable devices'), with or without a strategy (plain Keras after "
            "`jax.distributed.initialize`). TF's 'CPU:0' is the task's own.",
        )
        for case in (
            "",
            "_cw",
            "_infinite",
            "_infinite_cw",
            "_multithreading",
            "_multithreading_cw",
            "_multithreading_infinite",
        )
    },
    "trainers/trainer_test.py::JAXTrainerCorrectnessTest::"
    "test_jit_fit_with_out_shardings_logic_distributed": (
        ("multi_worker_mirrored",),
        "It makes its own `keras.distribution.DataParallel` over `jax.devices()` (which "
        "takes precedence over the strategy); across 2 processes Keras itself refuses NumPy "
        "input to it ('When using a multi-worker distribution with auto-sharding enabled, "
        "the data must be provided as a `tf.data.Dataset`').",
    ),
    "trainers/trainer_test.py::TestTrainer::test_loss_weights": (
        ("parameter_server",),
        "It checks the loss after 4 epochs against one device's training to atol=1e-3. "
        + _PS_ASYNCHRONOUS,
    ),
    **{
        "trainers/trainer_test.py::TestTrainer::"
        f"test_steps_per_execution_steps_count_unknown_dataset_size_{n}_{mode}": (
            ("parameter_server",),
            "It compares the epoch losses and weights of a fit with a batch-level callback "
            "against a fit without one, to 1e-6. A callback that reads a batch's logs makes "
            "the steps run one after another (so that its logs are that batch's); without "
            "one they run asynchronously. " + _PS_ASYNCHRONOUS,
        )
        for n in (3, 101)
        for mode in ("eager", "jit", "non_jit")
    },
}
