"""PipelineModel.generate: the tokens of the unsplit KerasHub CausalLM.

Tiny backbones built from config (no download), dropout 0, greedy
sampling: token ids and padding masks must be equal, not close.
"""

import keras
import numpy as np
import pytest

import keras_pipe
from tests.support import tools

keras_hub = pytest.importorskip(
    "keras_hub", reason="KerasHub task models need keras_hub")

pytestmark = pytest.mark.slow  # a traced decode loop per case

SEQ, VOCAB = 16, 50


def _gpt2():
    backbone = keras_hub.models.GPT2Backbone(
        vocabulary_size=VOCAB, num_layers=4, num_heads=2, hidden_dim=8,
        intermediate_dim=16, max_sequence_length=SEQ, dropout=0.0)
    return keras_hub.models.GPT2CausalLM(backbone=backbone,
                                         preprocessor=None)


def _llama():
    backbone = keras_hub.models.LlamaBackbone(
        vocabulary_size=VOCAB, num_layers=4, num_query_heads=4,
        num_key_value_heads=2, hidden_dim=16, intermediate_dim=32)
    return keras_hub.models.LlamaCausalLM(backbone=backbone,
                                          preprocessor=None)


def _prompts(rows, seed=0):
    """Prompts of 2 to 5 tokens, right-padded to SEQ."""
    rng = np.random.default_rng(seed)
    tokens = np.zeros((rows, SEQ), "int32")
    mask = np.zeros((rows, SEQ), "int32")
    for r, n in enumerate(rng.integers(2, 6, rows)):
        tokens[r, :n] = rng.integers(1, VOCAB, n)
        mask[r, :n] = 1
    return {"token_ids": tokens, "padding_mask": mask}


def _pair(devices, make, num_stages=2):
    model = make()
    model.compile(sampler="greedy")
    pipe = keras_pipe.PipelineModel.from_model(
        model, num_stages=num_stages, devices=devices[:num_stages])
    return model, pipe


@pytest.fixture(scope="module")
def gpt2_pair():
    """`(model, pipe, tokens)`: one GPT-2 and its 2-stage pipeline for the
    tests that do not change them, and the unsplit model's greedy tokens of
    `_prompts(5)`. Their `generate` calls of the same arguments reuse one
    traced loop."""
    from tests.conftest import DEVICES
    model, pipe = _pair(list(DEVICES), _gpt2)
    return model, pipe, model.generate(_prompts(5), stop_token_ids=None)


def _assert_same(got, expected):
    np.testing.assert_array_equal(got["token_ids"], expected["token_ids"])
    np.testing.assert_array_equal(got["padding_mask"],
                                  expected["padding_mask"])


@pytest.mark.parametrize("make", [_gpt2, _llama], ids=["gpt2", "llama"])
def test_greedy_tokens_equal_unsplit(devices, gpt2_pair, make):
    prompts = _prompts(5)  # 5 rows: micro-batches of 2, 2 and 1
    if make is _gpt2:
        model, pipe, expected = gpt2_pair
    else:
        model, pipe = _pair(devices, make)
        expected = model.generate(prompts, stop_token_ids=None)
    _assert_same(pipe.generate(prompts, stop_token_ids=None), expected)
    # As many micro-batches as stages (3 and 2 rows), one row.
    _assert_same(pipe.generate(prompts, stop_token_ids=None,
                               num_micro_batches=2), expected)
    one = {k: v[:1] for k, v in prompts.items()}
    _assert_same(pipe.generate(one, stop_token_ids=None),
                 model.generate(one, stop_token_ids=None))


def test_three_stages_and_strip_prompt(devices):
    model, pipe = _pair(devices, _gpt2, num_stages=3)
    prompts = _prompts(4, seed=1)
    _assert_same(pipe.generate(prompts, stop_token_ids=None,
                               strip_prompt=True),
                 model.generate(prompts, stop_token_ids=None,
                                strip_prompt=True))


def test_stop_tokens_end_the_loop_as_the_task(gpt2_pair):
    model, pipe, free = gpt2_pair
    prompts = _prompts(5)
    # A token generated early in row 0 and one generated late in row 3:
    # rows stop at different steps, micro-batches at different ticks.
    lengths = prompts["padding_mask"].sum(axis=1)
    stops = [int(free["token_ids"][0, lengths[0]]),
             int(free["token_ids"][3, SEQ - 2])]
    expected = model.generate(prompts, stop_token_ids=stops)
    # The stop tokens matter: the loop ended early or masks changed.
    assert not np.array_equal(expected["padding_mask"],
                              free["padding_mask"])
    _assert_same(pipe.generate(prompts, stop_token_ids=stops), expected)
    _assert_same(pipe.generate(prompts, stop_token_ids=stops[:1]),
                 model.generate(prompts, stop_token_ids=stops[:1]))


def test_bad_arguments(devices, gpt2_pair):
    _, pipe, _ = gpt2_pair
    with pytest.raises(ValueError, match="num_micro_batches must be an int"):
        pipe.generate(_prompts(4), stop_token_ids=None, num_micro_batches=1)
    plain = keras_pipe.PipelineModel.from_model(
        keras.Sequential([keras.Input((4,)), keras.layers.Dense(2),
                          keras.layers.Dense(2)]),
        num_stages=2, devices=devices[:2])
    with pytest.raises(TypeError, match="KerasHub CausalLM"):
        plain.generate(_prompts(2))


class _Constant(keras_hub.samplers.Sampler):
    """Picks token `value` whatever the logits: its use shows in the
    tokens."""

    def __init__(self, value):
        super().__init__()
        self.value = value

    def get_next_token(self, probabilities):
        return keras.ops.full(keras.ops.shape(probabilities)[:1],
                              self.value, "int32")


def _generated(out, prompts):
    """The generated positions of each row (after its prompt)."""
    lengths = prompts["padding_mask"].sum(axis=1)
    return [out["token_ids"][r, n:] for r, n in enumerate(lengths)]


def test_compiled_sampler_wins_over_the_task(devices):
    model, pipe = _pair(devices, _gpt2)  # the task compiled greedy
    prompts = _prompts(5)
    greedy = model.generate(prompts, stop_token_ids=None)
    pipe.compile(sampler=_Constant(7))
    got = pipe.generate(prompts, stop_token_ids=None)
    assert all((row == 7).all() for row in _generated(got, prompts))
    model.compile(sampler=_Constant(7))
    _assert_same(got, model.generate(prompts, stop_token_ids=None))
    # A sampler compiled anew replaces the traced loop's; top-k with k = 1
    # is greedy whatever its random draw, while the task samples top-5.
    model.compile(sampler="top_k")
    pipe.compile(sampler=keras_hub.samplers.TopKSampler(k=1, seed=3))
    _assert_same(pipe.generate(prompts, stop_token_ids=None), greedy)
    pipe.compile(sampler="greedy")
    _assert_same(pipe.generate(prompts, stop_token_ids=None), greedy)
    # Compiled without one: the task's sampler again.
    model.compile(sampler=_Constant(3))
    pipe.compile()
    got = pipe.generate(prompts, stop_token_ids=None)
    assert all((row == 3).all() for row in _generated(got, prompts))


def test_compile_with_a_sampler_still_trains_and_is_saved(devices):
    _, pipe = _pair(devices, _gpt2)
    pipe.compile(optimizer="sgd",
                 loss=keras.losses.SparseCategoricalCrossentropy(
                     from_logits=True),
                 sampler=keras_hub.samplers.TopKSampler(k=1, seed=3))
    prompts = _prompts(4)
    history = pipe.fit(prompts, prompts["token_ids"], batch_size=4,
                       epochs=1, verbose=0)
    assert np.isfinite(history.history["loss"][0])
    # The compile config keeps the sampler: a loaded model samples alike.
    _, other = _pair(devices, _gpt2)
    other.compile_from_config(pipe.get_compile_config())
    assert isinstance(other._sampler, keras_hub.samplers.TopKSampler)
    assert other._sampler.k == 1


@pytest.fixture(scope="module")
def bad_sampler_pair():
    """One GPT-2 pair for the bad samplers: each is refused before Keras'
    compile, so the pipeline stays uncompiled from case to case."""
    from tests.conftest import DEVICES
    return _pair(list(DEVICES), _gpt2)


@pytest.mark.parametrize("sampler, error, match", [
    ("topk", ValueError, "Unknown sampler 'topk'.*'greedy', 'top_k'"),
    ("Greedy", ValueError, "Unknown sampler 'Greedy'"),
    (3, TypeError, "sampler name .* or a keras_hub.samplers.Sampler"),
    (keras_hub.samplers.TopKSampler, TypeError,
     r"a class; pass an instance, TopKSampler\(...\)"),
    (keras_hub.samplers.BeamSampler(num_beams=2), ValueError,
     "BeamSampler runs its own loop.*pipe.to_model\\(\\).generate"),
], ids=["unknown", "uppercase", "int", "class", "beam"])
def test_bad_sampler_fails_at_compile(bad_sampler_pair, sampler, error,
                                      match):
    model, pipe = bad_sampler_pair
    model.compile(sampler="greedy")  # as `_pair` made it
    with pytest.raises(error, match=match):
        pipe.compile(optimizer="sgd", sampler=sampler)
    assert not pipe.compiled  # raised before Keras' compile
    # The task's own sampler is checked too, when generate reads it.
    if error is ValueError and not isinstance(sampler, str):
        model.compile(sampler=sampler)
        with pytest.raises(ValueError, match="runs its own loop"):
            pipe.generate(_prompts(2), stop_token_ids=None)


def _loop_body(pipe, jit_compile=True, rows=5):
    """The GraphDef function of the body of the decode loop traced for
    `rows` prompts and no stop token at the default `num_micro_batches`."""
    _, function = pipe._generators[(None, jit_compile, False)]
    concrete, = [
        c for c in function._list_all_concrete_functions_for_serialization()
        if c.structured_input_signature[0][0]["token_ids"].shape[0] == rows
        and c.structured_input_signature[0][1] is None]  # stop_token_ids
    graph = concrete.graph.as_graph_def()
    loop, = [n for n in graph.node if n.op in ("While", "StatelessWhile")]
    return {f.signature.name: f for f in graph.library.function}[
        loop.attr["body"].func.name]


def test_caches_stay_on_their_stage_between_rounds(devices, gpt2_pair):
    # The loop returned every loop variable through an Identity on the
    # head's device: each round sent every cache of the other stages to
    # the head's worker and back, which cost more than the decode itself.
    _, pipe, _ = gpt2_pair
    pipe.generate(_prompts(5), stop_token_ids=None)
    body = _loop_body(pipe)
    nodes = {n.name: n for n in body.node_def}
    crossing = []
    for node in body.node_def:
        for source in node.input:
            source = nodes.get(source.lstrip("^").split(":")[0])
            if source is not None and source.device and node.device \
                    and source.device != node.device:
                crossing.append((source.name, node.name))
    # What crosses: hidden states of one token and scalar positions.
    assert crossing
    assert not [c for c in crossing if "stack" in c[0] or "Identity" in c[1]]
    # Each returned cache is made on its stage's device.
    returned = [nodes[v.split(":")[0]] for v in body.ret.values()
                if v.split(":")[0] in nodes]
    stages = {d for d in devices[:2]}
    for node in returned:
        if node.op == "Identity" and "stack" in node.input[0]:
            source = nodes[node.input[0].split(":")[0]]
            assert node.device == source.device
            assert any(node.device.endswith(d.split("device:")[-1])
                       for d in stages)


def _compiled_calls(body):
    """`[device, ...]` of the body's calls of functions XLA must compile."""
    return [n.device for n in body.node_def
            if n.op in ("PartitionedCall", "StatefulPartitionedCall")
            and n.attr["_XlaMustCompile"].b]


def test_each_stages_tick_is_one_xla_function_on_its_device(devices,
                                                            gpt2_pair):
    # A token's work per stage is many small ops: one XLA cluster per
    # stage and tick, each on its own device (XLA compiles for one device:
    # the loop across the stages stays uncompiled).
    _, pipe, expected = gpt2_pair
    prompts = _prompts(5)
    _assert_same(pipe.generate(prompts, stop_token_ids=None), expected)
    calls = _compiled_calls(_loop_body(pipe))
    # The default M = K + 1 = 3: each stage runs 3 times a round, on its
    # own device.
    generator, _ = pipe._generators[(None, True, False)]
    assert generator.num_micro_batches == 3
    assert len(calls) == 6, calls
    assert sorted({c.split("device:")[-1] for c in calls}) == sorted(
        d.split("device:")[-1] for d in devices[:2]), calls
    _assert_same(pipe.generate(prompts, stop_token_ids=None,
                               jit_compile=False), expected)
    assert _compiled_calls(_loop_body(pipe, jit_compile=False)) == []
    with pytest.raises(TypeError, match=r"jit_compile must be True .* "
                       r"Received: jit_compile='yes'"):
        pipe.generate(prompts, jit_compile="yes")


def test_generate_shares_the_workers_cores_and_then_runs_m_equal_k(
        gpt2_pair, monkeypatch):
    # On pinned local workers the call runs inside `cores_shared`, which
    # says the handoff is fast: the default M is then K (here faked: the
    # stages are logical devices, which it leaves alone).
    import contextlib

    from keras_pipe.distributed import local
    model, pipe, expected = gpt2_pair
    seen = []

    @contextlib.contextmanager
    def shared(devices):
        seen.append(list(devices))
        yield True

    monkeypatch.setattr(local, "cores_shared", shared)
    prompts = _prompts(5)
    _assert_same(pipe.generate(prompts, stop_token_ids=None), expected)
    assert seen == [pipe.devices]
    generator, _ = pipe._generators[(None, True, True)]
    assert generator.num_micro_batches == 2


def test_generate_on_worker_processes_equals_unsplit():
    # Two `keras_pipe.distributed.worker` processes, as
    # tools/generation_capacity.py runs them (there with a memory limit):
    # the tokens of the unsplit model in a process of its own.
    tool = tools.load("generation_capacity")
    args = tool.parse_args([
        "--layers", "2", "--width", "32", "--heads", "2", "--vocab", "64",
        "--length", "12", "--prompts", "3", "--balance", "5,3"])
    expected = tool.run_unsplit(args, None)
    got = tool.run_pipelined(args, 2**40)
    assert not expected.get("failed") and not got.get("failed"), (
        expected, got)
    assert got["weights_sum"] == expected["weights_sum"]
    assert got["token_ids"] == expected["token_ids"]
    assert all(peak for peak in got["peaks"])  # both workers were watched


def test_exported_decode_loop_keeps_devices_and_tokens(devices, gpt2_pair,
                                                       tmp_path):
    import tensorflow as tf
    model, pipe, free = gpt2_pair
    prompts = _prompts(5)
    inputs = {"token_ids": tf.constant(prompts["token_ids"]),
              "padding_mask": tf.constant(prompts["padding_mask"] > 0)}
    stops = [int(free["token_ids"][3, SEQ - 2])]
    pipe.export_generate(str(tmp_path / "free"), 5, SEQ, verbose=False)
    pipe.export_generate(str(tmp_path / "stops"), 5, SEQ,
                         stop_token_ids=stops, verbose=False)
    for name, expected in (
            ("free", free),
            ("stops", model.generate(prompts, stop_token_ids=stops))):
        loaded = tf.saved_model.load(str(tmp_path / name))
        out = loaded.generate(inputs)
        _assert_same({k: v.numpy() for k, v in out.items()}, expected)
    # The loop's ops keep the stages' devices in the SavedModel.
    from tests.test_export import saved_devices
    found = set().union(*saved_devices(str(tmp_path / "free")).values())
    for device in devices[:2]:
        assert any(d.endswith(device.split("device:")[-1]) for d in found)
    with pytest.raises(ValueError, match=r"batch_size must be >= 1. "
                       r"Received: batch_size=0"):
        pipe.export_generate(str(tmp_path / "x"), 0, SEQ)
    with pytest.raises(TypeError, match=r"sequence_length must be an int. "
                       r"Received: sequence_length=8.0"):
        pipe.export_generate(str(tmp_path / "x"), 5, 8.0)
    with pytest.raises(ValueError, match="stop_token_ids must be None"):
        pipe.export_generate(str(tmp_path / "x"), 5, SEQ,
                             stop_token_ids=["end"])
