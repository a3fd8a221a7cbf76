"""Ported tf-keras tests that fail on a keras_dist bug: ``"file::test[id]"`` -> the bug.

``conftest.py`` runs each as ``xfail(strict=True)``: when the bug is fixed, the test
passes, strict xfail reports it as a failure, and its line here is removed. A ``*``
in a key matches any characters (the other characters match themselves).
"""

KNOWN_FAILURES = {
    "test_distribute_strategy.py::test_optimizer_in_cross_replica_context_raises_error[*]": (
        "optimizer.apply_gradients in the cross-replica context applies the gradients instead "
        "of raising tf-keras's RuntimeError"
    ),
    "test_distribute_strategy.py::test_host_training_loop_dataset_unknown_size[default]": (
        "on the default strategy (plain Keras 3's loop), with steps_per_epoch=50 and "
        "steps_per_execution=20 on data that goes on, the epoch's last execution runs 20 "
        "steps, not 10 (60 then 40 steps; the other strategies run 50 and 50)"
    ),
    "test_distribute_strategy.py::test_host_training_loop_last_partial_execution[default]": (
        "on the default strategy, the epoch's last, shorter execution ends at batch 59, not 49 "
        "(Keras 3's begin + steps_per_execution - 1; the other strategies give 49)"
    ),
    "test_distribute_strategy.py::test_host_training_loop_truncate_to_epoch[default]": (
        "on the default strategy, steps_per_execution=500 past a 50-step epoch ends at batch "
        "499, not 49 (Keras 3's index; the other strategies give 49)"
    ),
}
