"""tf-keras's own distribute tests (``tf_keras/distribute/``), ported to keras_dist.

Each ``test_<name>.py`` ports tf-keras's ``<name>_test.py`` by the substitutions of
``docs/porting.md``: ``tf.distribute`` -> ``keras_dist``, ``GradientTape`` ->
``kd.value_and_grad``, ``tf.function`` -> ``kd.function``, ``tf.data`` -> NumPy arrays,
``strategy.experimental_make_numpy_dataset`` or lists of batches. The assertions,
tolerances and expected numbers are tf-keras's; every distributed result is compared
with the no-strategy result computed in the same test, as tf-keras does.

tf-keras's strategy combinations map to five local strategies (``_strategies.py``):
``default`` (``kd.get_strategy()`` outside any scope), ``one_device``
(``OneDeviceStrategy("/cpu:0")``), ``mirrored1`` and ``mirrored2`` (``MirroredStrategy``
on one and two CPUs), ``central_storage2`` (``CentralStorageStrategy`` on two CPUs).

- ``known_failures.py``: ``KNOWN_FAILURES``, the ported tests that fail on a keras_dist
  bug, run as strict xfails (``conftest.py`` marks them): once the bug is fixed the
  test fails until its line is removed.
- ``not_applicable.py``: ``NOT_APPLICABLE``, the reviewed list of tf-keras tests left
  out (Keras 2-only APIs, graph mode, Estimator, TF internals), each with its reason.

The whole port, slow parametrizations included (about 20 minutes on 2 busy cores;
``-n 2`` halves it)::

    python -m pytest tests/parity/tf_keras -p no:cacheprovider -n 0

A run that names no path inside this folder (the README's CI command, or
``python -m pytest tests/parity``) runs the part not marked ``tf_keras_full`` (about 2
minutes) and reports the rest as skipped; ``-m tf_keras_full`` runs the marked part.
"""
