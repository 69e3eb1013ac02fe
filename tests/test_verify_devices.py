"""keras_pipe.verify whatever devices the pipeline's variables are on.

`from_model` places each stage's variables on its device; verify's plain
Keras reference runs on a copy of the weights on the first device, since
Keras runs some layers (a grouped `Conv2D`, ConvNeXt's depthwise
convolution) as XLA functions, which cannot read a variable on another
device. Tolerance: verify's default, 1e-3 of each variable's update.
"""

import keras
import numpy as np

import keras_pipe
from keras_pipe.engine import placement

CE = keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def _grouped_conv_model():
    inputs = keras.Input((6, 6, 4))
    h = keras.layers.Conv2D(4, 3, padding="same", name="first")(inputs)
    h = keras.layers.Conv2D(4, 3, padding="same", groups=4,
                            name="grouped")(h)
    h = keras.layers.GlobalAveragePooling2D(name="pool")(h)
    return keras.Model(inputs, keras.layers.Dense(3, name="logits")(h))


def test_grouped_conv_cut_over_two_devices_is_verified(devices):
    model = _grouped_conv_model()
    x = np.random.default_rng(0).normal(size=(4, 6, 6, 4)).astype("float32")
    y = (np.arange(4) % 3).astype("int32")
    start = [v.numpy() for v in model.weights]
    # The grouped kernel on the second device, the first stage on the first.
    report = keras_pipe.verify(model, x, y, loss=CE, optimizer="adam",
                               devices=devices[:2], balance=[1, 3])
    assert report.ok, report
    assert report.largest < 1e-4, report
    np.testing.assert_allclose(report.losses_pipeline, report.losses_keras,
                               rtol=1e-5)
    grouped = model.get_layer("grouped").kernel
    assert placement.device_of(grouped).endswith("CPU:1")
    for v, s in zip(model.weights, start):
        np.testing.assert_array_equal(v.numpy(), s)


class Noisy(keras.layers.Layer):
    """Dense then a Dropout of its own, made from the constructor's rate."""

    def __init__(self, units, rate, **kwargs):
        super().__init__(**kwargs)
        self.units, self.rate = units, rate
        self.dense = keras.layers.Dense(units, activation="tanh")
        self.dropout = keras.layers.Dropout(rate)

    def call(self, x, training=False):
        return self.dropout(self.dense(x), training=training)

    def get_config(self):
        return {**super().get_config(), "units": self.units,
                "rate": self.rate}


def test_dropout_inside_a_layer_is_set_aside_in_the_reference(devices):
    # The reference is a clone: a layer rebuilt from its config makes its
    # Dropout anew at rate 0.5, which verify must set aside there too.
    inputs = keras.Input((6,))
    h = Noisy(8, 0.5, name="noisy")(inputs)
    model = keras.Model(inputs, keras.layers.Dense(3, name="logits")(h))
    x = np.random.default_rng(0).normal(size=(8, 6)).astype("float32")
    y = (np.arange(8) % 3).astype("int32")
    report = keras_pipe.verify(model, x, y, loss=CE, optimizer="adam",
                               devices=devices[:2])
    assert report.ok, report
    assert model.get_layer("noisy").dropout.rate == 0.5


class Shift(keras.layers.Layer):
    """Adds a fixed array: no config Keras can rebuild it from."""

    def __init__(self, offset, **kwargs):
        super().__init__(**kwargs)
        self.offset = offset

    def call(self, x):
        return x + self.offset


def test_a_model_keras_cannot_clone_runs_as_it_is(devices):
    # clone_model fails (Shift takes an array it cannot serialize): plain
    # Keras runs the model itself, here with both stages on one device.
    inputs = keras.Input((6,))
    h = keras.layers.Dense(8, activation="tanh", name="first")(inputs)
    h = Shift(np.linspace(0, 1, 8).astype("float32"), name="shift")(h)
    model = keras.Model(inputs, keras.layers.Dense(3, name="logits")(h))
    with np.testing.assert_raises(Exception):
        keras.models.clone_model(model)
    x = np.random.default_rng(0).normal(size=(8, 6)).astype("float32")
    y = (np.arange(8) % 3).astype("int32")
    report = keras_pipe.verify(model, x, y, loss=CE, optimizer="adam",
                               devices=devices[:1] * 2)
    assert report.ok, report
