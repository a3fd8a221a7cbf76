"""`keras_dist.value_and_grad` and the optimizer's path inside replicas."""

import keras
import numpy as np
import pytest
from conftest import cpus

import keras_dist as kd


def test_value_and_grad_outside_any_strategy():
    w = keras.Variable(np.array([1.0, 2.0], "float32"))
    b = keras.Variable(0.5)
    loss, grads = kd.value_and_grad(lambda x: keras.ops.sum(w * x) + b * b, [w, b])(3.0)
    assert float(loss) == pytest.approx(9.25)
    np.testing.assert_allclose(grads[0], [3.0, 3.0])
    assert float(grads[1]) == pytest.approx(1.0)


def test_value_and_grad_has_aux_and_keeps_assignments():
    w = keras.Variable(2.0)
    counter = keras.Variable(0.0)

    def loss_fn():
        counter.assign(counter + 1.0)
        return w * w, "aux"

    (loss, aux), grads = kd.value_and_grad(loss_fn, [w], has_aux=True)()
    assert (float(loss), aux, float(grads[0])) == (4.0, "aux", 4.0)
    assert float(counter.numpy()) == 1.0


def test_gradients_inside_a_replica_are_that_replicas_own(engine):
    strategy = kd.MirroredStrategy(cpus(4))
    with strategy.scope():
        w = keras.Variable(1.0)
    x = strategy.experimental_distribute_values_from_function(
        lambda ctx: np.float32(ctx.replica_id_in_sync_group + 1)
    )

    def step(x):
        return kd.value_and_grad(lambda: w * x, [w])()[1][0]

    grads = strategy.experimental_local_results(strategy.run(step, args=(x,)))
    assert [float(g) for g in grads] == [1.0, 2.0, 3.0, 4.0]


class _BatchMean(keras.layers.Layer):
    """Keeps running statistics of its inputs in variables of each aggregation."""

    def build(self, input_shape):
        self.mean = self.add_weight(
            shape=(), initializer="zeros", aggregation="mean", trainable=False
        )
        self.total = self.add_weight(
            shape=(), initializer="zeros", aggregation="sum", trainable=False
        )
        self.scale = self.add_weight(shape=(), initializer="ones")

    def call(self, x):
        self.mean.assign(0.5 * self.mean + 0.5 * keras.ops.mean(x))
        self.total.assign_add(keras.ops.sum(x))
        return x * self.scale


def test_assignments_inside_loss_fn_are_kept_with_their_aggregation(engine):
    strategy = kd.MirroredStrategy(cpus(2))
    with strategy.scope():
        layer = _BatchMean()
        layer.build((None, 1))
    batches = [np.array([[1.0], [3.0], [5.0], [7.0]], "float32")]

    def step(x):
        def loss_fn():
            return kd.nn.compute_average_loss(keras.ops.sum(layer(x), axis=-1))

        return kd.value_and_grad(loss_fn, layer.trainable_variables)()[1][0]

    for batch in strategy.experimental_distribute_dataset(batches):
        grads = strategy.run(step, args=(batch,))
    # Replica 0 sees [1, 3] (mean 2), replica 1 [5, 7] (mean 6).
    assert float(layer.mean.numpy()) == pytest.approx(0.5 * (2.0 + 6.0) / 2)
    assert float(layer.total.numpy()) == pytest.approx(16.0)
    # d loss / d scale on each replica: its rows' sum over the global batch of 4.
    assert [float(g) for g in strategy.experimental_local_results(grads)] == [1.0, 3.0]


def test_model_built_inside_run_gets_mirrored_variables(engine):
    strategy = kd.MirroredStrategy(cpus(2))
    with strategy.scope():
        model = keras.Sequential([keras.layers.Dense(2, kernel_initializer="ones")])
    x = np.ones((4, 3), "float32")
    out = strategy.run(lambda x: model(x), args=(x,))
    assert all(isinstance(v, kd.MirroredVariable) for v in model.weights)
    for value in strategy.experimental_local_results(out):
        np.testing.assert_allclose(value, np.full((4, 2), 3.0))


def _stateless_training(strategy, steps=3):
    keras.utils.set_random_seed(3)
    with strategy.scope():
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3), keras.layers.Dense(1)])
        optimizer = keras.optimizers.Adam(0.05)
        optimizer.build(model.trainable_variables)
    rng = np.random.default_rng(0)
    x = rng.normal(size=(16, 4)).astype("float32")
    y = rng.normal(size=(16, 1)).astype("float32")

    def step(inputs):
        xb, yb = inputs

        def loss_fn():
            error = model(xb) - yb
            return kd.nn.compute_average_loss(keras.ops.mean(error * error, axis=-1))

        _, grads = kd.value_and_grad(loss_fn, model.trainable_variables)()
        trainable, slots = optimizer.stateless_apply(
            [v.value for v in optimizer.variables],
            grads,
            [v.value for v in model.trainable_variables],
        )
        for variable, value in zip(model.trainable_variables, trainable):
            variable.assign(value)
        for variable, value in zip(optimizer.variables, slots):
            variable.assign(value)

    dataset = strategy.experimental_distribute_dataset([(x, y)])
    for _ in range(steps):
        for batch in dataset:
            strategy.run(step, args=(batch,))
    return [v.numpy() for v in model.weights], int(optimizer.iterations.numpy())


def test_stateless_apply_inside_replicas_matches_one_device(engine):
    reference, iterations = _stateless_training(kd.OneDeviceStrategy("/cpu:0"))
    mirrored, mirrored_iterations = _stateless_training(kd.MirroredStrategy(cpus(4)))
    assert iterations == mirrored_iterations == 3
    for got, want in zip(mirrored, reference):
        np.testing.assert_allclose(got, want, atol=1e-5)


def test_value_and_grad_of_an_unbuilt_model_says_to_build_it():
    strategy = kd.MirroredStrategy(cpus(2))
    with strategy.scope():
        model = keras.Sequential([keras.layers.Dense(1)])  # no Input: no weights yet
    x = np.ones((4, 3), "float32")
    with pytest.raises(ValueError, match="Build the model first.*Received: variables=\\[\\]"):
        kd.value_and_grad(lambda: model(x).sum(), model.trainable_variables)()


def test_mean_of_integer_replica_ids_is_a_float_as_in_tf(engine):
    strategy = kd.MirroredStrategy(cpus(4))
    ids = strategy.run(lambda: kd.get_replica_context().replica_id_in_sync_group)
    assert float(strategy.reduce("MEAN", ids, axis=None)) == 1.5
    assert int(strategy.reduce("SUM", ids, axis=None)) == 6


# TF 2.21, the same step (MirroredStrategy on one CPU, tf.GradientTape, AdamW(0.1,
# weight_decay=0.5), 3 steps): the unused layer's gradients are None, Keras's optimizer
# skips them with a warning, and its weights stay [1, 1], [0]; the used layer's end at:
_TF_USED_AFTER_3_STEPS = [[0.5825238823890686, 0.5852774381637573], [-0.23327773809432983]]


@pytest.mark.parametrize("devices", [1, 2])
@pytest.mark.parametrize("compiled", [False, True], ids=["run", "kd.function"])
def test_a_variable_the_loss_does_not_use_gets_none_and_keeps_its_value(engine, devices, compiled):
    strategy = kd.MirroredStrategy(cpus(devices))
    x = np.arange(8, dtype="float32").reshape(4, 2) / 8
    y = np.array([[1.0], [0.0], [1.0], [0.0]], "float32")
    with strategy.scope():
        used = keras.layers.Dense(1, kernel_initializer="ones")
        unused = keras.layers.Dense(1, kernel_initializer="ones")
        used.build((None, 2))
        unused.build((None, 2))
        optimizer = keras.optimizers.AdamW(0.1, weight_decay=0.5)
    variables = used.trainable_variables + unused.trainable_variables
    grads_seen = []

    def replica_fn(x, y):
        def loss_fn():
            return kd.nn.compute_average_loss(keras.ops.sum((used(x) - y) ** 2, axis=1))

        loss, grads = kd.value_and_grad(loss_fn, variables)()
        grads_seen.append([g is None for g in grads])
        optimizer.apply_gradients(zip(grads, variables))
        return loss

    def step(x, y):
        return strategy.run(replica_fn, args=(x, y))

    if compiled:
        step = kd.function(step)
    batches = strategy.experimental_distribute_dataset([(x, y)] * 3)
    with pytest.warns(UserWarning, match="Gradients do not exist for variables"):
        for batch in batches:
            step(*batch)
    assert grads_seen[-1] == [False, False, True, True]
    weights = [np.asarray(v.value).ravel().tolist() for v in variables]
    np.testing.assert_allclose(weights[0], _TF_USED_AFTER_3_STEPS[0], rtol=1e-6)
    np.testing.assert_allclose(weights[1], _TF_USED_AFTER_3_STEPS[1], rtol=1e-6)
    assert weights[2:] == [[1.0, 1.0], [0.0]]  # JAX's zeros had decayed them to 0.857


def _batch_norm_model():
    return keras.Sequential(
        [
            keras.Input((3,)),
            keras.layers.Dense(4, kernel_initializer=keras.initializers.GlorotUniform(1)),
            keras.layers.BatchNormalization(),
            keras.layers.Dense(1, kernel_initializer=keras.initializers.GlorotUniform(2)),
        ]
    )


def _batch_norm_gradients(strategy):
    """A loss's gradients over all of a batch-norm model's variables, in a replica."""
    with strategy.scope():
        model = _batch_norm_model()
    x = np.random.default_rng(0).normal(size=(4, 3)).astype("float32")

    def replica_fn(x):
        def loss_fn():
            return keras.ops.mean((model(x, training=True) - 1.0) ** 2)

        return kd.value_and_grad(loss_fn, model.variables)()

    loss, grads = strategy.run(replica_fn, args=(x,))
    local = strategy.experimental_local_results
    grads = [None if g is None else np.asarray(local(g)[0]) for g in grads]
    moving = [np.asarray(v.value) for v in model.non_trainable_variables]
    return float(local(loss)[0]), grads, moving


@pytest.mark.parametrize(
    "make_strategy",
    [lambda: kd.OneDeviceStrategy("/cpu:0"), lambda: kd.MirroredStrategy(cpus(1))],
    ids=["one_device", "mirrored_one_replica"],
)
def test_one_replica_gradient_over_non_trainable_variables(engine, make_strategy):
    expected = _batch_norm_gradients(kd.get_strategy())
    loss, grads, moving = _batch_norm_gradients(make_strategy())
    assert loss == pytest.approx(expected[0], rel=1e-6)
    # The moving statistics have no gradient (TF's tape: None); the others are one device's.
    assert [g is None for g in grads] == [g is None for g in expected[1]]
    assert sum(g is None for g in grads) == 2
    for got, want in zip(grads, expected[1]):
        if want is not None:
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    for got, want in zip(moving, expected[2]):
        np.testing.assert_allclose(got, want, rtol=1e-6)


def test_a_loss_of_several_values_is_differentiated_as_their_sum(engine):
    # tape.gradient(target, w) of a non-scalar target: the gradient of its sum.
    strategy = kd.MirroredStrategy(cpus(2))
    with strategy.scope():
        w = keras.Variable(np.array([1.0, 2.0], "float32"))

    def replica_fn(x):
        return kd.value_and_grad(lambda: w * w * x, [w])()

    loss, grads = strategy.run(replica_fn, args=(np.float32(3.0),))
    for value in strategy.experimental_local_results(loss):
        np.testing.assert_allclose(value, [3.0, 12.0])  # the loss as it is
    for value in strategy.experimental_local_results(grads[0]):
        np.testing.assert_allclose(value, [6.0, 12.0])  # d/dw sum(3 w^2) = 6 w


def test_integer_variables_get_no_gradient(engine):
    # An LSTM's or a Dropout's seed state is an integer variable in ``model.variables``.
    strategy = kd.MirroredStrategy(cpus(2))
    with strategy.scope():
        model = keras.Sequential(
            [keras.Input((3,)), keras.layers.Dense(2, kernel_initializer="ones"),
             keras.layers.Dropout(0.5)]
        )  # fmt: skip
    integers = [v for v in model.variables if "int" in str(v.dtype)]
    assert integers, "the Dropout layer's seed state is an integer variable"

    def replica_fn(x):
        return kd.value_and_grad(lambda: keras.ops.sum(model(x)), model.variables)()

    loss, grads = strategy.run(replica_fn, args=(np.ones((4, 3), "float32"),))
    for variable, grad in zip(model.variables, grads):
        if "int" in str(variable.dtype):
            assert grad is None
        else:
            value = strategy.experimental_local_results(grad)[0]
            assert np.asarray(value).shape == tuple(variable.shape)
    kernel = strategy.experimental_local_results(grads[0])[0]
    np.testing.assert_allclose(kernel, np.full((3, 2), 4.0))  # every replica: the 4 rows


class _AddsItsInputsSum(keras.layers.Layer):
    def call(self, x):
        self.add_loss(keras.ops.sum(x))
        return x


def test_losses_a_layer_adds_are_seen_inside_a_loss_function(engine):
    # model.losses inside the loss holds what the call added, as eagerly and on TF's tape.
    strategy = kd.MirroredStrategy(cpus(2))
    with strategy.scope():
        model = keras.Sequential(
            [keras.Input((1,)), keras.layers.Dense(1, kernel_initializer="ones"),
             _AddsItsInputsSum()]
        )  # fmt: skip

    def replica_fn(x):
        def loss_fn():
            out = model(x)
            return keras.ops.sum(out) + keras.ops.sum(model.losses), len(model.losses)

        (loss, count), grads = kd.value_and_grad(loss_fn, model.trainable_variables, True)()
        return loss, count, grads[0]

    loss, count, kernel_grad = strategy.run(replica_fn, args=(np.full((2, 1), 3.0, "float32"),))
    assert {int(n) for n in strategy.experimental_local_results(count)} == {1}
    for value in strategy.experimental_local_results(loss):
        assert float(value) == pytest.approx(12.0)  # sum(out) = 6, and the added loss 6
    for value in strategy.experimental_local_results(kernel_grad):
        np.testing.assert_allclose(value, [[12.0]])  # 2 * sum(x)
