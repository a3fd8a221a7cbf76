"""Train and test steps for a batch that does not split evenly between replicas.

The last batch of an epoch often has a number of rows that is not a multiple
of the replica count. One SPMD program needs equal shapes on every replica,
and padding would let the padded rows into metrics that ignore sample weights
(AUC, Precision, ... in Keras 3). So each replica processes exactly its rows,
with Keras's own stateless pieces compiled per replica shape:

1. on each replica, ``compute_loss_and_updates`` and its gradient, the loss
   scaled by the replica's share of the global batch (and reduced as a part of
   it: ``replica_batch_share``);
2. the gradients summed, and the optimizer's ``stateless_apply`` run once;
3. on each replica, Keras's metric update for its rows.

That is Keras's JAX ``train_step`` taken apart at the point where tf.distribute
reduces gradients; ``test_step`` has no such point and runs whole per replica.
A model that overrides ``train_step`` or ``test_step`` itself runs on the eager
engine instead (slower, same numbers).
"""

import functools

import jax
import numpy as np

from keras_dist._input import batch_rows
from keras_dist._keras import compute_loss_and_updates
from keras_dist._keras import global_sample_weights
from keras_dist._keras import keras_update_metrics
from keras_dist._keras import model_layers
from keras_dist._keras import needs_every_replica
from keras_dist._keras import overrides_keras_step
from keras_dist._keras import recording_sample_weights
from keras_dist._keras import replica_batch_share
from keras_dist._keras import unpack_x_y_sample_weight as _unpack
from keras_dist._values import select_replica
from keras_dist._values._variables import SyncOnReadVariable
from keras_dist.layers import SyncBatchNormalization


class PerShapeSteps:
    """Per-replica compiled steps for batches of unequal per-replica sizes."""

    def __init__(self, model, strategy):
        self.model = model
        self.extended = strategy.extended
        self._jitted: dict = {}

    def supports(self, model) -> bool:
        """Keras's own steps, and no layer that needs the other replicas' rows."""
        if any(isinstance(layer, SyncBatchNormalization) for layer in model_layers(model)):
            return False  # its statistics need a collective: the eager engine says so
        return not overrides_keras_step(model)

    def _jit(self, name, fn):
        if name not in self._jitted:
            self._jitted[name] = jax.jit(fn)
        return self._jitted[name]

    def _values(self, variables, index):
        """Each variable's value for replica ``index``, on that replica's device."""
        return [variable.component(index) for variable in variables]

    def _assign_component(self, variables, index, values):
        for variable, value in zip(variables, values):
            if isinstance(variable, SyncOnReadVariable):
                variable.write_component(index, "assign", value)
            elif index == 0:
                variable.assign(value)

    def train(self, split, global_rows):
        model = self.model
        n = self.extended.num_local_replicas
        grad_step = self._jit("grad", functools.partial(_grad_step, model))
        update_metrics = self._jit("metrics", functools.partial(keras_update_metrics, model))
        apply = self._jit("apply", model.optimizer.stateless_apply)
        target = self.extended.local_devices[0]
        weights = self._global_weight_sums(split)
        summed, auxes, datas = None, [], []
        for index in range(n):
            data = select_replica(index, split)
            rows = batch_rows(data)
            grads, aux = grad_step(
                self._values(model.trainable_variables, index),
                self._values(model.non_trainable_variables, index),
                self._values(model.metrics_variables, index),
                self._values(model.optimizer.variables, index),
                data,
                rows / global_rows,
                weights,
            )
            grads = jax.device_put(grads, target)
            summed = (
                grads if summed is None else jax.tree_util.tree_map(jax.numpy.add, summed, grads)
            )
            auxes.append(aux)
            datas.append(data)
        # Across processes the other workers' replicas' gradients are added too.
        summed = self.extended.placement.cross_process_sum(summed)
        trainable, optimizer_values = apply(
            self._values(model.optimizer.variables, 0),
            summed,
            self._values(model.trainable_variables, 0),
        )
        for variable, value in zip(model.trainable_variables, trainable):
            variable.assign(value)
        for variable, value in zip(model.optimizer.variables, optimizer_values):
            variable.assign(value)
        for index, (aux, data) in enumerate(zip(auxes, datas)):
            unscaled_loss, y_pred, non_trainable, metrics = aux
            x, y, sample_weight = _unpack(data)
            _, metrics = update_metrics(metrics, unscaled_loss, x, y, y_pred, sample_weight)
            self._assign_component(model.non_trainable_variables, index, non_trainable)
            self._assign_component(model.metrics_variables, index, metrics)
        return model.get_metrics_result()

    def test(self, split, global_rows):
        model = self.model
        # Not ``model.test_step`` itself: JAX's trace cache takes two bound methods of one
        # model as the same function, and a recompiled model's metrics are new.
        test_step = self._jit("test", functools.partial(_test_step, model))
        weights = self._global_weight_sums(split)
        for index in range(self.extended.num_local_replicas):
            state = (
                self._values(model.trainable_variables, index),
                self._values(model.non_trainable_variables, index),
                self._values(model.metrics_variables, index),
            )
            data = select_replica(index, split)
            share = batch_rows(data) / global_rows
            _, (_, non_trainable, metrics) = test_step(state, data, share, weights)
            self._assign_component(model.non_trainable_variables, index, non_trainable)
            self._assign_component(model.metrics_variables, index, metrics)
        return model.get_metrics_result()

    def _global_weight_sums(self, split):
        """The global batch's sample-weight sums of its ``mean_with_sample_weight`` losses, in
        the order they are reduced: a first pass over every replica's rows (``None`` where the
        model has no such loss). The replicas' steps then divide by them, as one device does."""
        model = self.model
        if not needs_every_replica(model):
            return None
        record = self._jit("weights", functools.partial(_weight_sums, model))
        target = self.extended.local_devices[0]
        total = None
        for index in range(self.extended.num_local_replicas):
            sums = record(
                self._values(model.trainable_variables, index),
                self._values(model.non_trainable_variables, index),
                self._values(model.metrics_variables, index),
                select_replica(index, split),
            )
            sums = jax.device_put(sums, target)
            total = sums if total is None else jax.tree_util.tree_map(jax.numpy.add, total, sums)
        # On the host: each replica's step takes them on its own device.
        return [np.asarray(x) for x in self.extended.placement.cross_process_sum(total)]


def _weight_sums(model, trainable, non_trainable, metrics, data):
    x, y, sample_weight = _unpack(data)
    recorded = []
    with replica_batch_share(1.0), recording_sample_weights(recorded):
        compute_loss_and_updates(
            model, trainable, non_trainable, metrics, x, y, sample_weight, training=False
        )
    return recorded


def _test_step(model, state, data, share, weights):
    with replica_batch_share(share), global_sample_weights(weights):
        return model.test_step(state, data)


def _grad_step(model, trainable, non_trainable, metrics, optimizer_values, data, scale, weights):
    x, y, sample_weight = _unpack(data)

    def loss_fn(trainable):
        with replica_batch_share(scale), global_sample_weights(weights):
            loss, aux = compute_loss_and_updates(
                model,
                trainable,
                non_trainable,
                metrics,
                x,
                y,
                sample_weight,
                training=True,
                optimizer_variables=optimizer_values,
            )
        return loss * scale, aux

    (_, aux), grads = jax.value_and_grad(loss_fn, has_aux=True)(trainable)
    return grads, aux
