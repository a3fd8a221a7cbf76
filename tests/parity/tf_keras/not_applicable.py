"""tf-keras distribute tests left out of the port, reviewed: ``"file::test"`` -> why.

Keys name tf-keras's files and test methods (``tf_keras/distribute/``). A test ported
for some of its combinations and not others lists the left-out combinations here.
"""

_TPU = "TPUStrategy combination: no TPU in CI (TPUStrategy has its own tests, tests/core)"
_MWMS = (
    "MultiWorkerMirroredStrategy combination: needs processes; fit and custom loops on two "
    "workers against one device are covered by tests/multiprocess/test_multi_worker.py"
)
_V1 = (
    "tf-keras's v1 training loop (distributed_training_utils_v1.get_input_params): Keras 3 "
    "computes the steps, keras_dist takes global batch sizes"
)
_ADD_METRIC = "Layer.add_metric is Keras 2 only (Keras 3 has none)"
_PLAIN_KERAS_EXECUTIONS = (
    "the default strategy is plain Keras 3, whose loop keras_dist leaves as it is: its last "
    "execution of an epoch runs (and reports) all steps_per_execution steps, where tf-keras "
    "and keras_dist's strategies stop at the epoch's end (docs/differences.md)"
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
    # distribute_strategy_test.py
    "distribute_strategy_test.py::test_optimizer_in_cross_replica_context_raises_error": (
        "keras_dist applies gradients given in the cross-replica context, once, to the "
        "mirrored variables (one device's numbers), where tf-keras raises RuntimeError and "
        "Keras 3 on TF 2.21's MirroredStrategy fails in merge_call (AttributeError); Keras's "
        "own optimizer tests, run inside a strategy's scope, rely on it (docs/differences.md)"
    ),
    "distribute_strategy_test.py::test_host_training_loop_last_partial_execution[default]": (
        _PLAIN_KERAS_EXECUTIONS
    ),
    "distribute_strategy_test.py::test_host_training_loop_dataset_unknown_size[default]": (
        _PLAIN_KERAS_EXECUTIONS
    ),
    "distribute_strategy_test.py::test_host_training_loop_truncate_to_epoch[default]": (
        _PLAIN_KERAS_EXECUTIONS
    ),
    "distribute_strategy_test.py::test_calculating_input_params_no_steps_no_batch_size": _V1,
    "distribute_strategy_test.py::test_calculating_input_params_with_steps_no_batch_size": _V1,
    "distribute_strategy_test.py::test_calculating_input_params_no_steps_with_batch_size": _V1,
    "distribute_strategy_test.py::test_calculating_input_params_with_steps_with_batch_size": _V1,
    "distribute_strategy_test.py::*[tpu]": (
        _TPU + "; the TPU-only partial-batch tests run on the local strategies"
    ),
    "distribute_strategy_test.py::*[multi_worker_mirrored]": _MWMS,
    "distribute_strategy_test.py::*[mode=graph]": _GRAPH,
    "distribute_strategy_test.py::test_fit_eval_and_predict_with_optimizer[v1_optimizers]": (
        "tf.compat.v1.train optimizers are TF1's; the Keras v2 ones run as Keras 3's"
    ),
    "distribute_strategy_test.py::test_on_dataset_with_unknown_cardinality": (
        "TPU graph mode only, expecting tf-keras's 'Number of steps could not be inferred'; "
        "Keras 3 reads data of unknown size to its end"
    ),
    "distribute_strategy_test.py::test_host_training_loop_dataset_unknown_size[no_steps_raises]": (
        "expects a ValueError for steps_per_execution on data of unknown size; Keras 3 reads "
        "it to its end (the part with steps is ported)"
    ),
    "distribute_strategy_test.py::test_distributed_dataset[finite_without_steps_raises]": (
        "TF raised for any distributed dataset without steps on several replicas; keras_dist "
        "knows a finite one's length and reads it (an endless one raises, ported)"
    ),
    "distribute_strategy_test.py::test_gradient_clipping[central_storage]": (
        "expects 'not supported' (tf-keras's legacy optimizer could not clip under "
        "CentralStorageStrategy); keras_dist clips: ported with the clipped values"
    ),
    "distribute_strategy_test.py::test_custom_gradient_transformation": (
        "gradient_transformers is a Keras 2 optimizer argument (Keras 3 has none)"
    ),
    "distribute_strategy_test.py::test_distribution_strategy_with_add_metric_in_call": _ADD_METRIC,
    "distribute_strategy_test.py::test_distribution_strategy_with_add_metric_object": _ADD_METRIC,
    "distribute_strategy_test.py::test_distribution_strategy_with_add_metric_outside_call": (
        _ADD_METRIC
    ),
    "distribute_strategy_test.py::TestDistributionStrategyWithMultipleAddLossAndMetricCalls": (
        _ADD_METRIC + "; symbolic model.add_loss and get_output_at too"
    ),
    "distribute_strategy_test.py::test_sparse_tensor_outputs": (
        "a layer returning tf.SparseTensor: TensorFlow's type, JAX models return arrays"
    ),
    "distribute_strategy_test.py::test_ragged_tensor_outputs": (
        "a layer returning tf.RaggedTensor: TensorFlow's type, JAX has no ragged arrays"
    ),
    "distribute_strategy_test.py::test_unimplemented_parameter_server_strategy": (
        "tf.compat.v1 ParameterServerStrategy (TF1's, expected to raise NotImplementedError)"
    ),
    "distribute_strategy_test.py::"
    "test_predict_on_dataset_shard_options_file_multi_worker_mirrored": (
        _MWMS + "; TFRecord files"
    ),
    "distribute_strategy_test.py::TestModelCapturesStrategy::test_optimizer[v2_optimizer]": (
        "the part for tf-keras's V2 optimizer (restored outside the scope); Keras 3's "
        "optimizer, tf-keras's V3, is ported"
    ),
    # dataset_creator_model_fit_test.py
    "dataset_creator_model_fit_test.py::DatasetCreatorModelFitTest[multi_worker_mirrored]": _MWMS,
    "dataset_creator_model_fit_test.py::DatasetCreatorModelFitTest[parameter_server]": (
        "ParameterServerStrategy combination: needs a cluster of processes; fit with a "
        "DatasetCreator there is covered by tests/parameter_server"
    ),
    "dataset_creator_model_fit_test.py::testModelTrainTFFunction": (
        "model.train_tf_function is a tf.function (TensorFlow's); keras_dist compiles with JAX"
    ),
}
