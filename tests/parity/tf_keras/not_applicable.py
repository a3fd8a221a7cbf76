"""tf-keras distribute tests left out of the port, reviewed: ``"file::test"`` -> why.

Keys name tf-keras's files and test methods (``tf_keras/distribute/``). A test ported
for some of its combinations and not others lists the left-out combinations here.
"""

_TPU = "TPUStrategy combination: no TPU in CI (TPUStrategy has its own tests, tests/core)"
_MWMS = (
    "MultiWorkerMirroredStrategy combination: needs processes; fit and custom loops on two "
    "workers against one device are covered by tests/multiprocess/test_multi_worker.py"
)
_GRAPH = "graph mode (tf.compat.v1 / Graph().as_default()): JAX has no graph mode"

NOT_APPLICABLE = {
    # keras_dnn_correctness_test.py
    "keras_dnn_correctness_test.py::test_dnn_correctness[tpu]": _TPU,
    "keras_dnn_correctness_test.py::test_dnn_correctness[multi_worker_mirrored]": _MWMS,
    "keras_dnn_correctness_test.py::test_dnn_correctness[mode=graph]": _GRAPH,
    "keras_dnn_correctness_test.py::test_dnn_correctness_with_partial_last_batch[mwms]": _MWMS,
    "keras_dnn_correctness_test.py::test_dnn_correctness_with_partial_last_batch_eval[tpu]": (
        _TPU + "; ported over the local strategies instead"
    ),
    "keras_dnn_correctness_test.py::TestDistributionStrategyDnnCorrectnessWithSubclassedModel"
    "::test_dnn_correctness[mode=graph]": (
        "expects tf-keras's graph-mode error for subclassed models under a strategy; "
        "keras_dist runs them (the eager combination is ported)"
    ),
    "keras_dnn_correctness_test.py::TestDistributionStrategyDnnCorrectnessWithSubclassedModel"
    "::test_dnn_correctness_with_partial_last_batch_eval": (
        "TPU graph mode only, expecting an error for subclassed models"
    ),
    "keras_dnn_correctness_test.py::test_simple_dnn_metric_correctness[mwms]": _MWMS,
    "keras_dnn_correctness_test.py::test_identity_model_metric_eval_correctness[mwms]": _MWMS,
    # ctl_correctness_test.py
    "ctl_correctness_test.py::test_dnn_correctness_minus_tpus[multiworker]": _MWMS,
    "ctl_correctness_test.py::test_dnn_correctness_minus_tpus[jit_compile=True]": (
        "tf.function(jit_compile=True) on GPUs: every kd.function is compiled by XLA"
    ),
    "ctl_correctness_test.py::test_fused_batch_norm_uneven_batch": (
        "skipped in tf-keras itself (needs Fashion-MNIST from the network, b/234354008)"
    ),
    # keras_metrics_test.py
    "keras_metrics_test.py::testMean[tpu]": _TPU,
    "keras_metrics_test.py::testMean[mode=graph]": _GRAPH,
    "keras_metrics_test.py::testAddMetric": ("Layer.add_metric is Keras 2 only (Keras 3 has none)"),
    # custom_training_loop_models_test.py
    "custom_training_loop_models_test.py::KerasModelsTest[multiworker]": _MWMS,
    "custom_training_loop_models_test.py::KerasModelsTest[tpu]": _TPU,
    "custom_training_loop_models_test.py::test_customized_tf_module_run": (
        "tf.Module (name scopes, variable tracking) is TensorFlow's; keras_dist models are "
        "Keras layers and models"
    ),
    "custom_training_loop_models_test.py::"
    "test_nested_tf_functions_with_tf_function_passing_to_strategy_run": (
        "skipped in tf-keras itself (b/190608193)"
    ),
    "custom_training_loop_models_test.py::KerasModelsXLATest::test_tf_function_jit_compile": (
        _TPU + "; tf.function(jit_compile=True) in a layer's call: every step is XLA-compiled"
    ),
}
