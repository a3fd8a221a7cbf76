"""tf-keras's ``keras_metrics_test.py``: metrics updated in ``strategy.run`` give TF's values.

tf-keras builds these in graph mode (``make_input_fn_iterator``, ``self.evaluate``);
the port runs them eagerly: ``make_input_fn_iterator(input_fn)`` ->
``distribute_datasets_from_function`` (one dataset per worker, its batches dealt to the
replicas in turn, as there).
"""

import keras
import numpy as np
import pytest

import keras_dist as kd

from ._strategies import MIRRORED_AND_SINGLE
from ._strategies import params

STRATEGIES = params(MIRRORED_AND_SINGLE)


def _check_metric(strategy, batches, metric_init_fn, expected_fn):
    """tf-keras's ``_test_metric``: 4 input batches, ``num_replicas_in_sync`` an update."""
    with strategy.scope():
        metric = metric_init_fn()
    iterator = iter(strategy.distribute_datasets_from_function(lambda _: batches))

    @kd.function
    def update(inputs):
        return strategy.experimental_local_results(strategy.run(metric, args=(inputs,)))

    batches_per_update = strategy.num_replicas_in_sync
    batches_consumed = 0
    for i in range(4):
        batches_consumed += batches_per_update
        update(next(iterator))
        np.testing.assert_allclose(
            expected_fn(batches_consumed),
            float(metric.result()),
            rtol=0.001,
            err_msg=f"After update #{i + 1}",
        )
        if batches_consumed >= 4:  # Consume 4 input batches in total.
            break


@pytest.mark.parametrize("strategy", STRATEGIES, indirect=True)
def test_mean(strategy):
    values = np.arange(1000, dtype="float32")
    batches = [values[i : i + 4] for i in range(0, 1000, 4)]

    def _expected_fn(num_batches):
        # Mean(0..3) = 1.5, Mean(0..7) = 3.5, Mean(0..11) = 5.5, etc.
        return num_batches * 2 - 0.5

    _check_metric(strategy, batches, keras.metrics.Mean, _expected_fn)


def _run_metric(strategy, make_metric, label_prediction):
    with strategy.scope():
        metric = make_metric()
        strategy.run(metric, args=tuple(np.asarray(v) for v in label_prediction))
    return float(metric.result())


CASES = [
    # True positive is 2, false positive 1, precision is 2/3 = 0.6666667.
    pytest.param(keras.metrics.Precision, ([0, 1, 1, 1], [1, 0, 1, 1]), 0.6666667,
                 id="precision"),
    # True positive is 2, false negative 1, recall is 2/3 = 0.6666667.
    pytest.param(keras.metrics.Recall, ([0, 1, 1, 1], [1, 0, 1, 1]), 0.6666667, id="recall"),
    pytest.param(lambda: keras.metrics.SensitivityAtSpecificity(0.5),
                 ([0, 0, 0, 1, 1], [0, 0.3, 0.8, 0.3, 0.8]), 0.5, id="SensitivityAtSpecificity"),
    pytest.param(lambda: keras.metrics.SpecificityAtSensitivity(0.5),
                 ([0, 0, 0, 1, 1], [0, 0.3, 0.8, 0.3, 0.8]), 0.66666667,
                 id="SpecificityAtSensitivity"),
    pytest.param(lambda: keras.metrics.PrecisionAtRecall(0.5),
                 ([0, 0, 0, 1, 1], [0, 0.3, 0.8, 0.3, 0.8]), 0.5, id="PrecisionAtRecall"),
    pytest.param(lambda: keras.metrics.RecallAtPrecision(0.8),
                 ([0, 0, 1, 1], [0, 0.5, 0.3, 0.9]), 0.5, id="RecallAtPrecision"),
    pytest.param(lambda: keras.metrics.AUC(num_thresholds=3),
                 ([0, 0, 1, 1], [0, 0.5, 0.3, 0.9]), 0.75, id="auc"),
]  # fmt: skip


@pytest.mark.parametrize("make_metric, label_prediction, expected", CASES)
@pytest.mark.parametrize("strategy", STRATEGIES, indirect=True)
def test_metric_in_strategy_run(strategy, make_metric, label_prediction, expected):
    # test_precision, test_recall, test_SensitivityAtSpecificity, ...: every replica
    # updates the metric with the same rows, so the ratio is one update's.
    result = _run_metric(strategy, make_metric, label_prediction)
    np.testing.assert_allclose(result, expected, rtol=1e-6, atol=1e-6)
    # And the no-strategy result, computed here too.
    np.testing.assert_allclose(
        result, _run_metric(kd.get_strategy(), make_metric, label_prediction), rtol=1e-6
    )
