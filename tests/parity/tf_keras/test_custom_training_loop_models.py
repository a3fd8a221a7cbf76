"""tf-keras's ``custom_training_loop_models_test.py``: Keras models in custom loops.

tf-keras only checks that these steps run; each port also compares its numbers with
the same step run without a strategy, computed in the test. tf-keras's zero inputs are
seeded random ones where zeros would make every gradient zero. Its losses are
per-example vectors (``tape.gradient`` differentiates their sum); the port keeps them.
"""

import keras
import numpy as np
import pytest

import keras_dist as kd

from ._strategies import ALL
from ._strategies import params

STRATEGIES = params(ALL)
TOLERANCE = 1e-5  # float32 sums in another order; tf-keras compares nothing here


def _get_dataset(rows=31):
    rng = np.random.default_rng(0)
    inputs = rng.normal(size=(rows, 3)).astype("float32")
    targets = rng.normal(size=(rows, 4)).astype("float32")
    return [(inputs[i : i + 10], targets[i : i + 10]) for i in range(0, rows, 10)]


def _get_model():
    x = keras.Input((3,), name="input")
    return keras.Model(x, keras.layers.Dense(4, name="dense")(x))


def _weights_from(weights, make):
    model = make()
    model.set_weights(weights)
    return model


def _distribute(strategy, batches):
    if strategy is None:
        return list(batches)
    return strategy.experimental_distribute_dataset(batches)


def _train(strategy, make_model, weights, batches, make_optimizer, steps=None):
    """Trains with the per-example MSE; ``strategy=None`` runs the same loop without one."""
    with strategy.scope() if strategy else kd.get_strategy().scope():
        model = _weights_from(weights, make_model)
        optimizer = make_optimizer()

    def step_fn(inputs):
        images, targets = inputs

        def loss_fn():
            return keras.losses.mean_squared_error(targets, model(images))

        loss, grads = kd.value_and_grad(loss_fn, model.trainable_variables)()
        optimizer.apply_gradients(zip(grads, model.trainable_variables))
        return loss

    @kd.function
    def train_step(inputs):
        if strategy is None:
            return step_fn(inputs)
        return strategy.run(step_fn, args=(inputs,))

    iterator = iter(_distribute(strategy, batches))
    for _ in range(steps or len(batches)):
        train_step(next(iterator))
    return model.get_weights()


def _assert_same_weights(actual, expected):
    assert len(actual) == len(expected)
    for a, e in zip(actual, expected):
        np.testing.assert_allclose(a, e, atol=TOLERANCE, rtol=TOLERANCE)


@pytest.mark.parametrize("strategy", STRATEGIES, indirect=True)
def test_single_keras_layer_run(strategy):
    batches = _get_dataset()
    with strategy.scope():
        model = keras.layers.Dense(4, name="dense")
        model.build((None, 3))

    def grads_of(images, targets):
        loss_fn = lambda: keras.losses.mean_squared_error(targets, model(images))
        return kd.value_and_grad(loss_fn, model.trainable_variables)()[1]

    @kd.function
    def train_step(inputs):
        outputs = strategy.run(lambda batch: grads_of(*batch), args=(inputs,))
        return [strategy.experimental_local_results(g) for g in outputs]

    local_grads = train_step(next(iter(strategy.experimental_distribute_dataset(batches))))
    # The loss sums over rows: the replicas' gradients add up to the whole batch's.
    expected = grads_of(*batches[0])
    for local, whole in zip(local_grads, expected):
        np.testing.assert_allclose(sum(np.asarray(g) for g in local), whole, atol=TOLERANCE)


@pytest.mark.parametrize("strategy", STRATEGIES, indirect=True)
def test_keras_model_optimizer_run(strategy):
    # Every batch, the last one (1 row) included: on 2 replicas one of them gets none.
    batches = _get_dataset()
    weights = _get_model().get_weights()
    with_ds = _train(strategy, _get_model, weights, batches, keras.optimizers.RMSprop)
    without_ds = _train(None, _get_model, weights, batches, keras.optimizers.RMSprop)
    _assert_same_weights(with_ds, without_ds)


class KerasSubclassModel(keras.Model):
    def __init__(self):
        super().__init__()
        self.l = keras.layers.Dense(4, name="dense")

    def call(self, x):
        return self.l(x)


def _subclass_model():
    model = KerasSubclassModel()
    model(np.zeros((1, 3), "float32"))  # creates the weights (tf-keras: on first call)
    return model


@pytest.mark.parametrize("strategy", STRATEGIES, indirect=True)
def test_keras_subclass_model_optimizer_run(strategy):
    batches = _get_dataset()
    weights = _subclass_model().get_weights()
    with_ds = _train(strategy, _subclass_model, weights, batches, keras.optimizers.RMSprop, 1)
    without_ds = _train(None, _subclass_model, weights, batches, keras.optimizers.RMSprop, 1)
    _assert_same_weights(with_ds, without_ds)


@pytest.mark.parametrize("strategy", STRATEGIES, indirect=True)
def test_keras_model_optimizer_run_loop(strategy):
    # Four steps in one kd.function (tf-keras: ``for _ in tf.range(4)`` in a tf.function).
    batches = _get_dataset(40)
    weights = _get_model().get_weights()
    results = []
    for with_strategy in (strategy, None):
        with with_strategy.scope() if with_strategy else kd.get_strategy().scope():
            model = _weights_from(weights, _get_model)
            optimizer = keras.optimizers.RMSprop()

        def step_fn(inputs):
            images, targets = inputs
            loss_fn = lambda: keras.losses.mean_squared_error(targets, model(images))
            loss, grads = kd.value_and_grad(loss_fn, model.trainable_variables)()
            optimizer.apply_gradients(zip(grads, model.trainable_variables))
            return loss

        @kd.function
        def train_step(iterator, run=with_strategy.run if with_strategy else None):
            for _ in range(4):
                inputs = next(iterator)
                run(step_fn, args=(inputs,)) if run else step_fn(inputs)

        train_step(iter(_distribute(with_strategy, batches)))
        results.append(model.get_weights())
    _assert_same_weights(*results)


def _batch_norm_model():
    x = keras.Input((3, 3, 3), name="input")
    y = keras.layers.BatchNormalization(name="bn")(x)
    y = keras.layers.Flatten()(y)
    return keras.Model(x, keras.layers.Dense(4, name="dense")(y))


@pytest.mark.parametrize("strategy", STRATEGIES, indirect=True)
def test_batch_norm_with_dynamic_batch(strategy):
    # tf-keras's zeros: every replica's batch statistics equal the whole batch's.
    batches = [(np.zeros((10, 3, 3, 3), "float32"), np.zeros((10, 4), "float32"))] * 2
    weights = _batch_norm_model().get_weights()
    results = []
    for with_strategy in (strategy, None):
        with with_strategy.scope() if with_strategy else kd.get_strategy().scope():
            model = _weights_from(weights, _batch_norm_model)
            optimizer = keras.optimizers.RMSprop()

        def step_fn(inputs):
            images, targets = inputs
            loss_fn = lambda: keras.losses.mean_squared_error(targets, model(images, training=True))
            loss, grads = kd.value_and_grad(loss_fn, model.trainable_variables)()
            optimizer.apply_gradients(zip(grads, model.trainable_variables))
            return loss

        @kd.function
        def train_step(inputs, run=with_strategy.run if with_strategy else None):
            return run(step_fn, args=(inputs,)) if run else step_fn(inputs)

        train_step(next(iter(_distribute(with_strategy, batches))))
        results.append(model.get_weights())
    _assert_same_weights(*results)


@pytest.mark.parametrize("strategy", STRATEGIES, indirect=True)
def test_lstm(strategy):
    batch_size = 32
    np.random.seed(1337)
    x = np.random.rand(batch_size, 10, 1).astype("float32")
    y = np.random.rand(batch_size, 1).astype("float32")

    def create_lstm_model():
        # Only LSTM variables, to detect missing gradients more easily.
        return keras.Sequential([keras.Input((10, 1)), keras.layers.LSTM(1)])

    weights = create_lstm_model().get_weights()
    with strategy.scope():
        model = _weights_from(weights, create_lstm_model)
        optimizer = keras.optimizers.SGD()

    def loss_of(model, inps, targ):
        output = model(inps)
        return keras.ops.mean(keras.losses.binary_crossentropy(targ, output))

    def step_fn(inputs):
        inps, targ = inputs
        # tf-keras's ``model.variables``: Keras 3's also holds the LSTM's seed state.
        variables = model.trainable_variables
        loss, grads = kd.value_and_grad(lambda: loss_of(model, inps, targ), variables)()
        assert all(g is not None for g in grads)
        optimizer.apply_gradients(zip(grads, variables))
        return loss

    @kd.function
    def train_step(iterator):
        return strategy.experimental_local_results(strategy.run(step_fn, args=(next(iterator),)))

    dataset = strategy.experimental_distribute_dataset([(x, y)])
    losses = train_step(iter(dataset))
    # Each replica's loss is the mean over its rows, as the model gives it without one.
    plain = _weights_from(weights, create_lstm_model)
    rows = np.array_split(np.arange(batch_size), strategy.num_replicas_in_sync)
    expected = [float(loss_of(plain, x[r], y[r])) for r in rows]
    np.testing.assert_allclose([float(v) for v in losses], expected, atol=TOLERANCE)


def _nested_model():
    x = keras.Input((3,), name="input")
    return keras.Model(x, keras.layers.Dense(4, name="dense")(x))


@pytest.mark.parametrize("strategy", STRATEGIES, indirect=True)
def test_nested_tf_functions(strategy, tmp_path):
    # One step with the loss computed inline, one with it in a nested kd.function: the
    # two models (the same weights, through a weights file) stay the same.
    np.random.seed(1337)
    inputs = np.random.random((10, 3)).astype(np.float32)
    targets = np.ones((10, 4), dtype=np.float32)
    with strategy.scope():
        model = _nested_model()
        # tf-keras shares one optimizer between the models; Keras 3's optimizer
        # belongs to the variables it was built for, so each model has its own.
        optimizer = keras.optimizers.SGD(0.1, momentum=0.01)
        optimizer2 = keras.optimizers.SGD(0.1, momentum=0.01)
        weights_file = str(tmp_path / "model.weights.h5")
        model.save_weights(weights_file)
        model2 = _nested_model()
        model2.load_weights(weights_file)
    for v, v2 in zip(model.variables, model2.variables):
        np.testing.assert_allclose(np.asarray(v), np.asarray(v2))

    def compute_loss(images, targets):
        return keras.losses.mean_squared_error(targets, model(images))

    @kd.function
    def train_step_without_nested_function(inputs):
        def step_fn(inputs):
            loss, grads = kd.value_and_grad(lambda: compute_loss(*inputs), model.variables)()
            optimizer.apply_gradients(zip(grads, model.variables))

        strategy.run(step_fn, args=(inputs,))

    @kd.function
    def compute_loss2(images, targets):
        return keras.losses.mean_squared_error(targets, model2(images))

    @kd.function
    def train_step_with_nested_function(inputs):
        def step_fn(inputs):
            loss, grads = kd.value_and_grad(lambda: compute_loss2(*inputs), model2.variables)()
            optimizer2.apply_gradients(zip(grads, model2.variables))

        strategy.run(step_fn, args=(inputs,))

    dist_inputs = next(iter(strategy.experimental_distribute_dataset([(inputs, targets)])))
    train_step_without_nested_function(dist_inputs)
    train_step_with_nested_function(dist_inputs)
    before = model.get_weights()
    for v, v2 in zip(model.variables, model2.variables):
        np.testing.assert_allclose(np.asarray(v), np.asarray(v2))
    # And the step moved the weights as one device's does.
    plain = _train(None, _nested_model, model2.get_weights(), [(inputs, targets)],
                   lambda: keras.optimizers.SGD(0.1, momentum=0.01))  # fmt: skip
    assert not np.allclose(plain[0], before[0])


@pytest.mark.parametrize("strategy", STRATEGIES, indirect=True)
def test_nested_tf_functions_with_control_flow(strategy):
    # Ten steps, each a kd.function, inside a kd.function (tf-keras: ``tf.range(10)``).
    np.random.seed(1337)
    inputs = np.random.random((10, 3)).astype(np.float32)
    targets = np.ones((10, 4), dtype=np.float32)
    weights = _nested_model().get_weights()
    with strategy.scope():
        model = _weights_from(weights, _nested_model)
        optimizer = keras.optimizers.SGD(0.1, momentum=0.01)

    @kd.function
    def train_step(iterator):
        def step_fn(inputs):
            images, targets = inputs
            loss_fn = lambda: keras.losses.mean_squared_error(targets, model(images))
            _, grads = kd.value_and_grad(loss_fn, model.variables)()
            optimizer.apply_gradients(zip(grads, model.variables))

        strategy.run(step_fn, args=(next(iterator),))

    @kd.function
    def train_steps(iterator):
        for _ in range(10):
            train_step(iterator)

    # tf-keras's dataset repeats one batch of 10 rows.
    batches = [(inputs, targets)] * 10
    train_steps(iter(strategy.experimental_distribute_dataset(batches)))
    without_ds = _train(None, _nested_model, weights, batches,
                        lambda: keras.optimizers.SGD(0.1, momentum=0.01))  # fmt: skip
    _assert_same_weights(model.get_weights(), without_ds)


@pytest.mark.parametrize("strategy", STRATEGIES, indirect=True)
def test_reduce_loss(strategy):
    rng = np.random.default_rng(0)
    inputs = rng.normal(size=(10, 4)).astype("float32")
    targets = rng.integers(0, 3, size=(10, 1)).astype("float32")
    with strategy.scope():
        x = keras.Input((4,), name="input")
        model = keras.Model(x, keras.layers.Dense(3, name="dense", activation="softmax")(x))

    @kd.function
    def train_step(iterator):
        def step_fn(inputs):
            images, targets = inputs
            return keras.losses.sparse_categorical_crossentropy(targets, model(images))

        return strategy.run(step_fn, args=(next(iterator),))

    dataset = strategy.experimental_distribute_dataset([(inputs, targets)])
    loss = strategy.reduce(kd.ReduceOp.MEAN, train_step(iter(dataset)), axis=0)
    expected = np.mean(keras.losses.sparse_categorical_crossentropy(targets, model(inputs)))
    np.testing.assert_allclose(float(loss), expected, atol=TOLERANCE)


@pytest.mark.parametrize("strategy", STRATEGIES, indirect=True)
def test_variable_run_argument(strategy):
    # Variables passed to run() remain variables (TPUStrategy once cast them to tensors).
    with strategy.scope():
        optimizer = keras.optimizers.SGD(0.1)
        net = keras.layers.Dense(1, trainable=True)
        net.build((1,))
    kernel = float(np.asarray(net.kernel)[0, 0])
    features = np.ones((2, 1, 1), "float32")  # from_tensors([[1.0]]).repeat().batch(2)

    def replica_step(trainable_variables, features):
        def loss_fn():
            net_out = net(features[0], training=True)
            return (net_out - 1.0) * (net_out - 1.0)

        loss, gradients = kd.value_and_grad(loss_fn, trainable_variables)()
        optimizer.apply_gradients(zip(gradients, trainable_variables))
        return loss

    @kd.function
    def step(features):
        per_replica_losses = strategy.run(replica_step, (net.trainable_variables, features))
        return strategy.reduce(kd.ReduceOp.SUM, per_replica_losses, axis=None)

    dist_features = next(iter(strategy.experimental_distribute_dataset([features])))
    loss = step(dist_features)
    # Each replica's row is [1.0]: loss (k - 1)^2 there, gradient 2 (k - 1) for the
    # kernel and the bias, summed over the replicas by the optimizer.
    replicas = strategy.num_replicas_in_sync
    np.testing.assert_allclose(np.asarray(loss).sum(), replicas * (kernel - 1.0) ** 2, rtol=1e-5)
    np.testing.assert_allclose(
        np.asarray(net.kernel)[0, 0], kernel - 0.1 * replicas * 2 * (kernel - 1.0), rtol=1e-5
    )
