"""Shapes for plan and the cost-based balances: given, propagated, guessed.

Sizes are exact integers computed by hand from the shapes.
"""

import warnings

import keras
import numpy as np
import pytest
from keras import layers

import keras_pipe
from keras_pipe.planning import partition
from keras_pipe.planning.balance import cost
from keras_pipe.planning.balance.shapes import infer_shapes
from keras_pipe.planning.graph import read_graph

SEQ, VOCAB, WIDTH = 32, 20, 8


def _token_model():
    """Token ids of unknown length (None, None), as KerasHub models take."""
    tokens = keras.Input((None,), dtype="int32", name="token_ids")
    x = layers.Embedding(VOCAB, WIDTH, name="embed")(tokens)
    x = layers.MultiHeadAttention(2, 4, name="attn")(x, x)
    x = layers.Dense(WIDTH, name="ff")(x)
    return keras.Model(tokens, layers.Dense(VOCAB, name="logits")(x),
                       name="lm")


def _quiet_plan(*args, **kwargs):
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        return keras_pipe.plan(*args, **kwargs)


def test_unknown_length_is_guessed_with_a_warning_naming_the_input():
    with pytest.warns(UserWarning, match=(
            r"keras_pipe.plan of 'lm' guessed each unknown dimension other "
            r"than the batch as 1: input 'token_ids' has shape \(None, None\)"
            r": dimension\(s\) \[1\] unknown.*input_shape=\(None, 128\)")):
        p = keras_pipe.plan(_token_model(), 2, num_micro_batches=1)
    assert p.stages[0].input_bytes == 1 * 4  # one token: the guess
    with pytest.warns(UserWarning, match=r"balance='flops' of 'lm' guessed"):
        partition.cut(_token_model(), 2, balance="flops")


def test_input_shape_and_sample_inputs_give_the_sizes():
    model = _token_model()
    p = _quiet_plan(model, 2, 2, batch_size=4, balance="flops",
                    input_shape=(None, SEQ))
    micro = 2
    assert p.stages[0].input_bytes == micro * SEQ * 4
    assert p.stages[-1].output_bytes == micro * SEQ * VOCAB * 4
    flops = dict(zip([c.name for c in read_graph(model).calls],
                     cost.flops(read_graph(model), micro,
                                infer_shapes(read_graph(model),
                                             {"token_ids": (None, SEQ)}))))
    assert flops["logits"] == micro * (2 * (WIDTH * VOCAB + VOCAB) * SEQ
                                       + SEQ * VOCAB)
    # Attention grows faster than the length: one guessed token costs less.
    guessed = cost.flops(read_graph(model), micro)
    assert flops["attn"] > SEQ * guessed[1]
    sample = np.zeros((3, SEQ), "int32")
    q = _quiet_plan(model, 2, 2, batch_size=4, balance="flops",
                    sample_inputs=sample)
    assert [s.flops for s in q.stages] == [s.flops for s in p.stages]
    assert q.sizes == p.sizes


def test_from_model_balances_with_the_given_shape(devices):
    model = _token_model()
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        pipe = keras_pipe.PipelineModel.from_model(
            model, 2, devices=devices[:2], balance="memory",
            input_shape=(None, SEQ), batch_size=8, num_micro_batches=2)
    expected = _quiet_plan(model, 2, 2, balance="memory", batch_size=8,
                           input_shape=(None, SEQ)).sizes
    assert [len(s.calls) for s in pipe.stages] == expected


def test_bad_input_shapes():
    model = _token_model()
    with pytest.raises(ValueError, match=(
            r"input_shape for 'token_ids' is \(None, 4, 4\), but the input "
            r"has shape \(None, None\): give its rank \(2")):
        keras_pipe.plan(model, 2, input_shape=(None, 4, 4))
    with pytest.raises(ValueError, match=(
            r"input_shape names inputs \['tokens'\] that 'lm' does not have; "
            r"its inputs are \['token_ids'\]")):
        keras_pipe.plan(model, 2, input_shape={"tokens": (None, 4)})
    with pytest.raises(TypeError, match="input_shape must be a shape"):
        keras_pipe.plan(model, 2, input_shape="32")
    with pytest.raises(ValueError, match="not both"):
        keras_pipe.plan(model, 2, input_shape=(None, 4),
                        sample_inputs=np.zeros((1, 4), "int32"))
