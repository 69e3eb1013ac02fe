"""Interrupts end the work: Ctrl-C or a failing callback stops the steps.

Stages on logical devices run `fit` in the calling thread; on remote
workers the call runs next to a watchdog (see test_cluster.py's
`test_interrupt_stops_remote_steps_and_fit_continues`).
"""

import os
import signal

import keras
import numpy as np
import pytest

import keras_pipe

pytestmark = pytest.mark.slow  # trains models: the full suite's tier

N, K, ROWS = 3, 3, 16


def _model(devices):
    keras.utils.set_random_seed(7)
    stages = [keras.Sequential([keras.layers.Dense(16, activation="relu"),
                                keras.layers.BatchNormalization()]),
              keras.Sequential([keras.layers.Dropout(0.25),
                                keras.layers.Dense(3)])]
    model = keras_pipe.PipelineModel(stages, devices=devices[:2],
                                     num_micro_batches=2)
    model.build((None, 8))
    model.compile(keras.optimizers.Adam(0.01),
                  keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


def _data():
    rng = np.random.default_rng(1)
    x = rng.normal(size=((N + K) * ROWS, 8)).astype("float32")
    y = rng.integers(0, 3, size=((N + K) * ROWS,)).astype("int32")
    return x, y


def _values(model):
    return [v.numpy() for v in model.variables + model.optimizer.variables]


class _Interrupt(keras.callbacks.Callback):
    def __init__(self, how):
        super().__init__()
        self.how, self.seen = how, 0

    def on_train_batch_end(self, batch, logs=None):
        self.seen += 1
        if self.seen == N:
            if self.how == "sigint":
                os.kill(os.getpid(), signal.SIGINT)
            elif self.how == "keyboard":
                raise KeyboardInterrupt
            else:
                raise ValueError("callback failed")


@pytest.fixture(autouse=True)
def _ctrl_c_raises():
    """SIGINT raises KeyboardInterrupt, as at a terminal, however the suite
    was started: a shell's background job starts with SIGINT ignored, and
    Python then installs no handler for it."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)


@pytest.mark.parametrize("how, kind", [("sigint", KeyboardInterrupt),
                                       ("keyboard", KeyboardInterrupt),
                                       ("error", ValueError)])
def test_interrupt_at_step_n_then_k_more_equals_n_plus_k(devices, how, kind):
    x, y = _data()
    fit = dict(batch_size=ROWS, epochs=1, shuffle=False, verbose=0)
    reference = _model(devices)
    reference.fit(x, y, **fit)
    model = _model(devices)
    with pytest.raises(kind):
        model.fit(x, y, callbacks=[_Interrupt(how)], **fit)
    assert int(model.optimizer.iterations.numpy()) == N
    model.fit(x[N * ROWS:], y[N * ROWS:], **fit)
    for a, b in zip(_values(model), _values(reference)):
        np.testing.assert_array_equal(a, b)
