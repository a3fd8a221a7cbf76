"""tf-keras's ``strategy_combinations``, as the local keras_dist strategies they map to."""

import pytest
from conftest import cpus

import keras_dist as kd

# tf-keras's names -> ours: default_strategy -> default, one_device_strategy -> one_device,
# mirrored_strategy_with_one_cpu -> mirrored1, mirrored_strategy_with_gpu_and_cpu and
# mirrored_strategy_with_two_gpus -> mirrored2, central_storage_strategy_with_gpu_and_cpu
# -> central_storage2. TPU, multi-worker and parameter-server combinations are left out
# (not_applicable.py says why).
STRATEGIES = {
    "default": kd.get_strategy,
    "one_device": lambda: kd.OneDeviceStrategy("/cpu:0"),
    "mirrored1": lambda: kd.MirroredStrategy(cpus(1)),
    "mirrored2": lambda: kd.MirroredStrategy(cpus(2)),
    "central_storage2": lambda: kd.experimental.CentralStorageStrategy(cpus(2)),
}

# strategy_combinations.all_strategies and strategies_minus_tpu, without TPUs.
ALL = list(STRATEGIES)
# strategies_minus_default_minus_tpu.
MINUS_DEFAULT = [name for name in ALL if name != "default"]
# keras_metrics_test's all_combinations (default, one device, mirrored).
MIRRORED_AND_SINGLE = ["default", "one_device", "mirrored1", "mirrored2"]
# The strategies whose parametrizations the CI run keeps for the slow harnesses:
# the others run with ``python -m pytest tests/parity/tf_keras``.
CI = ["mirrored2", "central_storage2"]


def make(name):
    """A fresh strategy for the name."""
    return STRATEGIES[name]()


def params(names, ci=None):
    """``pytest.param``s of ``names`` for the ``strategy`` fixture.

    With ``ci`` (a list of names), the others are marked ``tf_keras_full``: the CI run
    skips them, ``python -m pytest tests/parity/tf_keras`` runs them.
    """
    return [
        pytest.param(
            name,
            id=name,
            marks=() if ci is None or name in ci else pytest.mark.tf_keras_full,
        )
        for name in names
    ]
