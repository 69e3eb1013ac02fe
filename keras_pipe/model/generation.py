"""Pipelined generation for a pipeline cut from a KerasHub `CausalLM`.

The task's own `generate` runs every token through the layers one after
the other: cut into stages, one device works while the others wait. Here
the prompts are cut into `M >= K` micro-batches (`K` the number of devices
that hold decoder layers) that are on different stages at the same time,
and the decode loop is one `tf.while_loop` in one `tf.function`: each
iteration is a round of `M` clock ticks in which every stage runs once per
tick, each on another micro-batch, and every micro-batch gets one token.
Micro-batch `i` enters stage `j` at tick `g = i + j (mod M)` of its token:

```
M = K = 2, after a first tick that fills stage 0:
    tick           1      2      3      4
    stage 0      mb 1   mb 0   mb 1   mb 0     (its layers)
    stage 1      mb 0   mb 1   mb 0   mb 1     (its layers, the head, the
                 token  token  token  token     sampler, the embedding of
                                                the token for stage 0)
```

Each stage keeps the key/value cache of its own decoder layers, per
micro-batch, on its device, from one round to the next; only one token's
hidden state per micro-batch crosses a cut per tick. Nothing else does:
the weights are read once per call on their devices (the embedding's and
the head's on the head's device, where the sampled tokens are), and each
stage counts the rounds itself. The prompt is first run through the
stages micro-batch after micro-batch (prefill), which fills the caches.

A stage's layers on one tick are one XLA cluster on the stage's device
(`jit_compile=True`, the default): a token's work per stage is many small
ops, each of which costs more to launch than to run, and XLA fuses them.
The loop itself is not compiled: XLA compiles for one device, and the loop
spans them all; each stage's cluster runs on its own.

The task's code is reused for all but the loop: its `generate` (inputs,
batching, `stop_token_ids`, `strip_prompt`, the preprocessor) calls this
module's step function, the sampler's `compute_probabilities` and
`get_next_token` pick each token (the sampler of the pipeline's
`compile(sampler=...)`, else the task's: `keras_pipe.model.sampling`),
and the embedding and the head are the task's `call_with_cache` with its
decoder layers replaced by taps (a tap hands out or takes in the hidden
state). The result is the task's: the same tokens as the unsplit model
for a deterministic sampler (greedy), the loop stopping when every
sequence met a stop token, the positions after that left as the prompt
had them, and the same `padding_mask`.
"""

import contextlib

import keras
import tensorflow as tf

from keras_pipe import _compat, _validation
from keras_pipe.distributed import local
from keras_pipe.engine import microbatch, placement
from keras_pipe.model import sampling

__all__ = ["Generator", "export", "generate"]


class _Tapped(Exception):  # noqa: N818 - a signal, not an error
    """Carries the hidden state out of the task's `call_with_cache`."""

    def __init__(self, x):
        super().__init__("tapped")
        self.x = x


@contextlib.contextmanager
def _decoder_layers_replaced(backbone, layers):
    """The backbone's `transformer_layers` replaced by `layers` (plain
    callables, not tracked by Keras) while the block runs."""
    original = backbone.transformer_layers
    object.__setattr__(backbone, "transformer_layers", layers)
    try:
        yield
    finally:
        object.__setattr__(backbone, "transformer_layers", original)


def _device_groups(layers):
    """`[(device, [layer index, ...]), ...]`: consecutive decoder layers
    whose first weight lives on the same device."""
    groups = []
    for n, layer in enumerate(layers):
        device = placement.device_of(layer.weights[0])
        if groups and groups[-1][0] == device:
            groups[-1][1].append(n)
        else:
            groups.append((device, [n]))
    return groups


class Generator:
    """The pipelined `generate_step` of a `CausalLM` whose decoder layers
    live on several devices.

    Args:
        task: a KerasHub `CausalLM` (`call_with_cache`, `_build_cache`,
            `backbone.transformer_layers`, `sampler`).
        num_micro_batches: `M`, or None: as many as the stages (`K`)
            when `fast_handoff`, else one more (`K + 1`), so that the token
            the last stage samples for a micro-batch has a tick to reach
            the first stage before that stage needs it.
        sampler: a KerasHub sampler, or None: the task's.
        jit_compile: compile each stage's layers of a tick with XLA, on
            the stage's device.
        fast_handoff: whether a tensor reaches the next stage's device in
            a small part of a tick (`local.cores_shared` is in effect).

    Raises:
        TypeError: if `task` is not a KerasHub `CausalLM`, or
            `jit_compile` is not a bool.
        ValueError: if `num_micro_batches` is below the number of stages,
            or the sampler runs its own loop (`sampling.resolve`).
    """

    def __init__(self, task, num_micro_batches=None, sampler=None,
                 jit_compile=True, fast_handoff=False):
        backbone = getattr(task, "backbone", None)
        if not (hasattr(task, "call_with_cache")
                and hasattr(task, "_build_cache")
                and hasattr(backbone, "transformer_layers")):
            raise TypeError(
                "PipelineModel.generate needs a pipeline cut from a KerasHub "
                "CausalLM (GPT2CausalLM, LlamaCausalLM, ...), which "
                "`to_model()` returns. Received a pipeline of "
                f"{type(task).__name__}.")
        self.task = task
        self.backbone = backbone
        self.groups = _device_groups(list(backbone.transformer_layers))
        k = len(self.groups)
        m = num_micro_batches
        if m is None:
            m = k if fast_handoff else k + 1
        if isinstance(m, bool) or not isinstance(m, int) or m < k:
            raise ValueError(
                f"num_micro_batches must be an int >= the {k} stages that "
                "hold decoder layers, so that each stage has a micro-batch "
                f"to run at every tick. Received: num_micro_batches={m!r}")
        self.num_micro_batches = m
        self.jit_compile = _checked_jit_compile(jit_compile)
        self._compiled = {}  # stage -> `_stage_function`
        # The task's sampler may be one `compile(sampler=...)` refuses.
        self.sampler = sampling.resolve(sampler or task.sampler)
        self.head_device = self.groups[-1][0]
        self._cache_dims = None

    @property
    def num_stages(self):
        return len(self.groups)

    # ------------------------------------------------------ task pieces

    def _cache_shape(self, rows, length):
        """One decoder layer's cache shape `[rows, 2, length, heads, dim]`,
        read from the graph of the task's `_build_cache`."""
        if self._cache_dims is None:
            spec = tf.TensorSpec([1, 2], tf.int32)
            traced = tf.function(
                lambda t: _compat.build_cache(self.task, t)[1]
            ).get_concrete_function(spec)
            self._cache_dims = tuple(traced.output_shapes[-2:])
        return [rows, 2, length, *self._cache_dims]

    def _through_taps(self, token_ids, taps, index):
        """The task's `call_with_cache` with its decoder layers replaced by
        `taps`; returns the logits."""
        rows = tf.shape(token_ids)[0]
        cache = tf.zeros([rows, len(taps), 2, 1, 1, 1],
                         self.task.compute_dtype)
        with _decoder_layers_replaced(self.backbone, taps):
            logits, _, _ = self.task.call_with_cache(token_ids, cache, index)
        return logits

    def _embed(self, token_ids, index, weights=()):
        """The hidden state entering the first decoder layer, on the head's
        device (`weights`: `_head_weights`, read in their stead); the
        task's code stops there: no op of the later layers or the head is
        made."""
        def tap(x, self_attention_cache=None, **kwargs):
            raise _Tapped(x)

        n = len(self.backbone.transformer_layers)
        with tf.device(self.head_device), keras.StatelessScope(
                state_mapping=list(weights)):
            try:
                self._through_taps(token_ids, [tap] * n, index)
            except _Tapped as tapped:
                return tapped.x
        raise TypeError(
            f"{type(self.task).__name__}.call_with_cache did not call its "
            "backbone's transformer_layers: PipelineModel.generate cannot "
            "find where its embedding ends.")

    def _head_weights(self):
        """The weights of the embedding and the head, read on the head's
        device once per call (a tied embedding that lives on another
        stage's device is copied there): the embedding and the head of
        every tick then read them locally, not across a cut."""
        decoder = {id(v) for layer in self.backbone.transformer_layers
                   for v in layer.weights}
        with tf.device(self.head_device):
            return [(v, tf.identity(v.value)) for v in self.task.weights
                    if id(v) not in decoder]

    def _stage_weights(self, j):
        """Stage `j`'s decoder weights, read on its device once per call:
        the loop then holds no variable read, so that no round waits for
        the reads of every stage's previous round."""
        device, indices = self.groups[j]
        layers = self.backbone.transformer_layers
        with tf.device(device):
            return [(v, tf.identity(v.value)) for n in indices
                    for v in layers[n].weights]

    def _head(self, hidden, index, weights=()):
        """The logits of the last decoder layer's output `hidden`
        (`weights`: `_head_weights`, read in their stead)."""
        def first(x, self_attention_cache=None, **kwargs):
            return hidden, self_attention_cache

        def rest(x, self_attention_cache=None, **kwargs):
            return x, self_attention_cache

        n = len(self.backbone.transformer_layers)
        rows = tf.shape(hidden)[0]
        with tf.device(self.head_device), keras.StatelessScope(
                state_mapping=list(weights)):
            return self._through_taps(
                tf.zeros([rows, 1], tf.int32), [first] + [rest] * (n - 1),
                index)

    def _stage(self, j, x, caches, index, weights):
        """Stage `j`'s decoder layers with their caches, on its device
        (`weights`: `_stage_weights(j)`, read in their stead; with
        `jit_compile`, one XLA function of them)."""
        run = self._stage_function(j, [v for v, _ in weights])
        with tf.device(self.groups[j][0]):
            x, new = run(x, list(caches), index, [t for _, t in weights])
        return x, list(new)

    def _stage_function(self, j, variables):
        """`run(x, caches, index, values)`: stage `j`'s layers, reading
        `values` for `variables`; made once per stage, an XLA function
        with `jit_compile` (when the stage reads weights in its stead)."""
        if j in self._compiled:
            return self._compiled[j]
        layers = self.backbone.transformer_layers
        indices = self.groups[j][1]

        def run(x, caches, index, values):
            new = []
            with keras.StatelessScope(
                    state_mapping=list(zip(variables, values))):
                for n, cache in zip(indices, caches):
                    x, cache = layers[n](
                        x, self_attention_cache=cache,
                        self_attention_cache_update_index=index)
                    new.append(cache)
            return x, new

        if self.jit_compile and variables:
            run = tf.function(run, jit_compile=True, autograph=False)
        self._compiled[j] = run
        return run

    # ------------------------------------------------------- the step

    def generate_step(self, inputs, stop_token_ids=None):
        """The task's `generate_step`, pipelined (traced in a tf.function)."""
        # Ops without a stage of their own (the step counters, the loop's
        # control, the embedding and the sampler) run on the head's device:
        # this process takes no part in the loop. The loop returns each
        # loop variable through an Identity made outside any stage's
        # scope: it stays with its input, so that a stage's caches stay on
        # its device from one round to the next instead of crossing to the
        # head's device and back every round.
        with tf.compat.v1.device(_on_input_device_else(self.head_device)):
            return self._generate_step(inputs, stop_token_ids)

    def _generate_step(self, inputs, stop_token_ids):
        sampler = self.sampler
        token_ids = inputs["token_ids"]
        padding_mask = tf.cast(inputs["padding_mask"], tf.bool)
        batch, length = token_ids.shape
        k, m = self.num_stages, min(self.num_micro_batches, batch)
        if m < k:
            # Fewer rows than stages: copies of the last row fill the
            # micro-batches every tick needs; they are dropped at the end.
            m = k
            token_ids = _padded_rows(token_ids, k)
            padding_mask = _padded_rows(padding_mask, k)
        index = tf.reduce_min(tf.reduce_sum(
            tf.cast(padding_mask, tf.int32), axis=-1))
        max_steps = length - index
        rows = microbatch.split_sizes(token_ids.shape[0], m)
        starts = [sum(rows[:i]) for i in range(m)]
        prompts = [token_ids[s:s + b] for s, b in zip(starts, rows)]
        masks = [padding_mask[s:s + b] for s, b in zip(starts, rows)]

        head_weights = self._head_weights()
        weights = [self._stage_weights(j) for j in range(k)]
        # Prefill: every micro-batch through every stage, caches filled.
        caches = [[None] * m for _ in range(k)]
        for i in range(m):
            x = self._embed(prompts[i], 0, head_weights)
            for j, (device, indices) in enumerate(self.groups):
                with tf.device(device):
                    empty = [tf.zeros(self._cache_shape(rows[i], length),
                                      self.task.compute_dtype)
                             for _ in indices]
                x, caches[j][i] = self._stage(j, x, empty, 0, weights[j])

        # Each stage counts the rounds on its own device, from its own copy
        # of the last prompt position: no tick waits for a scalar from
        # another device.
        last = []
        for device, _ in self.groups:
            with tf.device(device):
                last.append(tf.identity(index - 1))

        def stage_call(j, t, rounds, tokens, caches, hidden, embedded,
                       sampled):
            """Stage `j` at tick `t` of its round `rounds[j]` (tick
            `K - 1 + t` of the decode ticks): returns its output, or None
            for the last stage, which samples micro-batch `i`'s next token
            and embeds it for stage 0's next call on `i`."""
            g = k - 1 + t - j
            i = g % m
            with tf.device(self.groups[j][0]):
                step = rounds[j] + g // m
                position = last[j] + step
            x = embedded[i] if j == 0 else hidden[j]
            x, caches[j][i] = self._stage(j, x, caches[j][i], position,
                                          weights[j])
            if j < k - 1:
                return x
            logits = tf.squeeze(self._head(x, position, head_weights),
                                axis=1)
            with tf.device(self.head_device):
                chosen = sampler.get_next_token(
                    sampler.compute_probabilities(logits))
                chosen = tf.cast(chosen, tokens[i].dtype)
                at = position + 1
                keep = masks[i][:, at]
                chosen = tf.where(keep, tokens[i][:, at], chosen)
                columns = tf.range(length)[None, :] == at
                tokens[i] = tf.where(columns, chosen[:, None], tokens[i])
                if stop_token_ids is not None:
                    done = _all_stopped(tokens[i], stop_token_ids, masks[i])
                    sampled[i] = tf.where(
                        tf.logical_and(sampled[i] < 0, done), step + 1,
                        sampled[i])
            embedded[i] = self._embed(chosen[:, None], at, head_weights)
            return None

        # The hidden state of each micro-batch's last token, embedded for
        # stage 0; the last stage replaces it with the next token's.
        embedded = [self._embed(tf.slice(p, [0, index - 1], [b, 1]),
                                index - 1, head_weights)
                    for p, b in zip(prompts, rows)]
        # Fill: ticks 0 .. K-2 of the first tokens, stage j on micro-batch
        # `g - j`.
        hidden = [None] * k
        for g in range(k - 1):
            outputs = {}
            for j in range(min(g, k - 2) + 1):
                i = g - j
                x = embedded[i] if j == 0 else hidden[j]
                x, caches[j][i] = self._stage(j, x, caches[j][i], index - 1,
                                              weights[j])
                outputs[j + 1] = x
            hidden = [None] + [outputs.get(j, hidden[j])
                               for j in range(1, k)]

        sampled = [tf.constant(-1) for _ in range(m)]

        def body(rounds, tokens, caches, hidden, embedded, sampled):
            tokens, embedded, sampled = (list(tokens), list(embedded),
                                         list(sampled))
            caches = [list(c) for c in caches]
            hidden = [None] + list(hidden)
            for t in range(m):
                outputs = {}
                for j in range(k):
                    x = stage_call(j, t, rounds, tokens, caches, hidden,
                                   embedded, sampled)
                    if x is not None:
                        outputs[j + 1] = x
                hidden = [None] + [outputs.get(j, hidden[j])
                                   for j in range(1, k)]
            following = []
            for (device, _), r in zip(self.groups, rounds):
                with tf.device(device):
                    following.append(r + 1)
            return following, tokens, caches, hidden[1:], embedded, sampled

        def cond(rounds, tokens, caches, hidden, embedded, sampled):
            going = rounds[-1] < max_steps
            if stop_token_ids is None:
                return going
            return tf.logical_and(going, tf.logical_not(tf.reduce_all(
                tf.stack(sampled) >= 0)))

        rounds = []
        for device, _ in self.groups:
            with tf.device(device):
                rounds.append(tf.constant(0))
        rounds, tokens, _, _, _, sampled = tf.while_loop(
            cond, body,
            (rounds, prompts, caches, hidden[1:], embedded, sampled))
        r = rounds[-1]
        if stop_token_ids is not None:
            finished = tf.reduce_all(tf.stack(sampled) >= 0)
            steps = tf.where(finished, tf.reduce_max(tf.stack(sampled)), r)
        else:
            steps = r
        # Positions after the last step of the unsplit loop keep the
        # prompt's values (a micro-batch ran on after it was done).
        after = tf.range(length)[None, :] >= index + steps
        token_ids = tf.concat(
            [tf.where(after, p, t) for p, t in zip(prompts, tokens)],
            axis=0)[:batch]
        padding_mask = padding_mask[:batch]
        return {"token_ids": token_ids,
                "padding_mask": _padding_mask(token_ids, padding_mask,
                                              stop_token_ids)}


def _checked_jit_compile(jit_compile):
    if not isinstance(jit_compile, bool):
        raise TypeError(
            "jit_compile must be True (each stage's layers compiled with XLA "
            f"on its device) or False. Received: jit_compile={jit_compile!r}")
    return jit_compile


def _on_input_device_else(default):
    """A device function: an op made without a device goes to `default`,
    but an Identity of a tensor placed elsewhere stays with that tensor
    (and one of a resource handle is left to TF, which puts it with its
    variable)."""
    def device(op):
        if op.device:
            return op.device
        if op.type == "Identity" and op.inputs:
            source = op.inputs[0]
            if source.dtype == tf.resource:
                return ""
            if source.device:
                return source.device
        return default
    return device


def _padded_rows(tensor, rows):
    """`tensor` with its last row repeated up to `rows` rows."""
    extra = rows - tensor.shape[0]
    return tf.concat([tensor, tf.repeat(tensor[-1:], extra, axis=0)], 0)


def _all_stopped(tokens, stop_token_ids, mask):
    """Whether every row holds a stop token at a generated position."""
    hit = tf.zeros_like(tokens, tf.bool)
    for value in stop_token_ids:
        hit = tf.logical_or(hit, tf.equal(tokens, value))
    hit = tf.logical_and(hit, tf.logical_not(mask))
    return tf.reduce_all(tf.reduce_any(hit, axis=-1))


def _padding_mask(token_ids, padding_mask, stop_token_ids):
    """The task's output mask: false after each row's first generated stop
    token (kept), all true without stop tokens."""
    if stop_token_ids is None:
        return tf.ones_like(token_ids, tf.bool)
    hit = tf.zeros_like(token_ids, tf.bool)
    for value in stop_token_ids:
        hit = tf.logical_or(hit, tf.equal(token_ids, value))
    ends = tf.cast(tf.logical_and(hit, tf.logical_not(padding_mask)),
                   tf.int32)
    overflow = tf.cumsum(ends, axis=-1) - ends
    return tf.logical_not(tf.cast(overflow, tf.bool))


def _sampler_of(pipe, task):
    """The pipeline's sampler (its `compile(sampler=...)`), else the
    task's."""
    return getattr(pipe, "_sampler", None) or getattr(task, "sampler", None)


def generate(pipe, inputs, max_length=None, stop_token_ids="auto",
             strip_prompt=False, num_micro_batches=None, jit_compile=True):
    """`PipelineModel.generate`: the task's `generate`, pipelined."""
    task = pipe.to_model()
    # The loop is traced again when either sampler is compiled anew.
    sampler = _sampler_of(pipe, task)
    _checked_jit_compile(jit_compile)
    # A tick hands a token's hidden state to the next stage: on pinned
    # local workers, their threads share their cores meanwhile, and the
    # handoff is then fast enough for `M = K`.
    with local.cores_shared(pipe.devices) as fast_handoff:
        key = (num_micro_batches, jit_compile, fast_handoff)
        cache = pipe.__dict__.setdefault("_generators", {})
        if key not in cache or cache[key][0].task is not task \
                or cache[key][0].sampler is not sampler:
            generator = Generator(task, num_micro_batches, sampler=sampler,
                                  jit_compile=jit_compile,
                                  fast_handoff=fast_handoff)
            cache[key] = (generator, tf.function(generator.generate_step,
                                                 autograph=False))
        saved = task.generate_function
        task.generate_function = cache[key][1]
        try:
            return task.generate(inputs, max_length=max_length,
                                 stop_token_ids=stop_token_ids,
                                 strip_prompt=strip_prompt)
        finally:
            task.generate_function = saved


def export(pipe, filepath, batch_size, sequence_length,
           num_micro_batches=None, stop_token_ids=None, verbose=None,
           jit_compile=True):
    """`PipelineModel.export_generate`: the pipelined decode loop as a
    SavedModel endpoint, its variables kept on their devices."""
    _validation.check_positive_int("batch_size", batch_size)
    _validation.check_positive_int("sequence_length", sequence_length)
    if stop_token_ids is not None:
        stop_token_ids = tuple(stop_token_ids)
        if not all(isinstance(t, int) and not isinstance(t, bool)
                   for t in stop_token_ids):
            raise ValueError(
                "stop_token_ids must be None or a list of token ids (ints) "
                "to bake into the exported loop. Received: "
                f"stop_token_ids={stop_token_ids!r}")
    task = pipe.to_model()
    generator = Generator(task, num_micro_batches,
                          sampler=_sampler_of(pipe, task),
                          jit_compile=jit_compile)
    spec = {"token_ids": tf.TensorSpec([batch_size, sequence_length],
                                       tf.int32),
            "padding_mask": tf.TensorSpec([batch_size, sequence_length],
                                          tf.bool)}
    archive = keras.export.ExportArchive()
    archive.track(task)
    archive.add_endpoint(
        "generate",
        lambda inputs: generator.generate_step(inputs, stop_token_ids),
        [spec])
    options = tf.saved_model.SaveOptions(
        experimental_variable_policy=(
            tf.saved_model.experimental.VariablePolicy.SAVE_VARIABLE_DEVICES))
    archive.write_out(filepath, options=options,
                      verbose=True if verbose is None else verbose)
