"""Builders shared by the tests: the same network pipelined and not."""

import keras
import numpy as np
import tensorflow as tf

import keras_pipe
from tests.support.data import random_data

IN_DIM, HIDDEN, NUM_CLASSES = 6, 8, 3


def dense_stages(num_stages, batch_norm=False, dropout=0.0):
    """`num_stages` Sequential stages of Dense layers (the last one: logits)."""
    stages = []
    for j in range(num_stages):
        layers = []
        if j < num_stages - 1:
            layers.append(keras.layers.Dense(HIDDEN, activation="tanh"))
            if batch_norm:
                layers.append(keras.layers.BatchNormalization())
            if dropout:
                layers.append(keras.layers.Dropout(dropout, seed=10 + j))
        else:
            layers.append(keras.layers.Dense(HIDDEN, activation="tanh"))
            layers.append(keras.layers.Dense(NUM_CLASSES))
        stages.append(keras.Sequential(layers, name=f"stage_{j}"))
    return stages


def pipeline_and_reference(num_stages, num_micro_batches, remat, devices,
                           schedule="gpipe", **stage_kwargs):
    """A PipelineModel and a one-device Sequential with the same weights."""
    return pair(lambda: dense_stages(num_stages, **stage_kwargs), devices,
                num_micro_batches, remat, schedule=schedule)


def pair(make_stages, devices, num_micro_batches, remat, schedule="gpipe"):
    """`make_stages()` pipelined, and its layers in one Sequential on CPU:0.

    Both start from the same weights.
    """
    stages = make_stages()
    pipe = keras_pipe.PipelineModel(
        stages, devices=devices[:len(stages)],
        num_micro_batches=num_micro_batches, remat=remat, schedule=schedule)
    pipe.build((None, IN_DIM))
    with tf.device("/device:CPU:0"):
        reference = keras.Sequential([keras.Input((IN_DIM,))] + [
            layer for stage in make_stages() for layer in stage.layers])
    reference.set_weights(pipe.get_weights())
    return pipe, reference


def compiled_pipeline(devices, num_stages, num_micro_batches, remat,
                      **stage_kwargs):
    """Dense stages in a built PipelineModel compiled with SGD and CE."""
    pipe = keras_pipe.PipelineModel(
        dense_stages(num_stages, **stage_kwargs), devices=devices[:num_stages],
        num_micro_batches=num_micro_batches, remat=remat)
    pipe.build((None, IN_DIM))
    pipe.compile("sgd", keras.losses.SparseCategoricalCrossentropy(
        from_logits=True))
    return pipe


def build_optimizer(model):
    """Makes `model`'s optimizer slots before its first step, as
    `PipelineModel.compile` does: made inside it (Keras' own), they make TF
    trace the train function twice."""
    if not model.optimizer.built:
        model.optimizer.build(model.trainable_variables)


def data(batch_size, seed=0):
    """`(x, y, sample_weight)` for `dense_stages`."""
    return random_data(batch_size, (IN_DIM,), classes=NUM_CLASSES,
                       weights=(0.1, 2.0), seed=seed)


def pipeline_loss_and_gradients(pipe, x, y, sample_weight=None):
    """Runs `compute_loss_and_gradients` in graph mode, as `fit` does."""

    @tf.function
    def step():
        return pipe.compute_loss_and_gradients(x, y, sample_weight)

    loss, y_pred, grads = step()
    return (np.asarray(loss), keras.tree.map_structure(np.asarray, y_pred),
            [g.numpy() for g in grads])


def reference_loss_and_gradients(model, x, y, sample_weight=None):
    with tf.GradientTape() as tape:
        y_pred = model(x, training=True)
        loss = model.compute_loss(x, y, y_pred, sample_weight)
    grads = tape.gradient(loss, model.trainable_variables)
    return (np.asarray(loss), keras.tree.map_structure(np.asarray, y_pred),
            [g.numpy() for g in grads])
