"""Per-stage remat (`remat=[...]`) trains exactly like the uniform modes."""

import keras
import numpy as np
import pytest

import keras_pipe
from tests.support import helpers

pytestmark = pytest.mark.slow  # the fast tier: `-m "not slow"`

STEPS = 3


def _trained(remat, devices, schedule):
    keras.utils.set_random_seed(5)
    pipe = keras_pipe.PipelineModel(
        helpers.dense_stages(3, batch_norm=True, dropout=0.2),
        devices=devices[:3], num_micro_batches=4, remat=remat,
        schedule=schedule)
    pipe.build((None, helpers.IN_DIM))
    pipe.compile(keras.optimizers.Adam(0.01),
                 keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return pipe


@pytest.mark.slow
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "zb_h1"])
def test_list_remat_matches_never_after_fit_steps(devices, schedule):
    x, y, _ = helpers.data(32)
    reference = _trained("never", devices, schedule)
    mixed = _trained(["always", "never", "except_last"], devices, schedule)
    # Same starting point (BatchNorm statistics and dropout seeds included).
    mixed.set_weights(reference.get_weights())
    for a, b in zip(reference.get_weights(), mixed.get_weights()):
        np.testing.assert_array_equal(a, b)
    history = [reference.fit(x, y, batch_size=32, epochs=STEPS, verbose=0,
                             shuffle=False),
               mixed.fit(x, y, batch_size=32, epochs=STEPS, verbose=0,
                         shuffle=False)]
    np.testing.assert_allclose(history[0].history["loss"],
                               history[1].history["loss"], rtol=1e-6)
    for a, b in zip(reference.get_weights(), mixed.get_weights()):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    # The weights did move: the comparison is not of untouched values.
    first = _trained("never", devices, schedule)
    moved = max(float(np.max(np.abs(a - b))) for a, b in zip(
        first.get_weights(), reference.get_weights()))
    assert moved > 1e-3
