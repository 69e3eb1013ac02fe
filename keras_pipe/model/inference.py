"""Pipelined inference: `predict` and `evaluate` as one stream of micro-batches.

Keras runs `predict` and `evaluate` one step function call per batch (or
per `steps_per_execution` batches, each its own step). Each call of a
pipeline's step fills the pipeline and drains it again, and this process
waits for the call's end before it sends the next batch: with `K` stages
the devices overlap only within one batch (`K M / (M + K - 1)` at best,
less the call's round trip). Here one call runs the forward passes of
`S` batches (`inference_steps_per_execution`) as one stream of `S M`
micro-batches in GPipe order (`Executor.forward_batches`): no backward
pass, no remat, the weights read once; `predict`'s outputs of each batch
sent to this process as soon as the last stage has them (the transfer
overlaps the next batches' work) and concatenated here; `evaluate`'s
losses and metrics computed on the last stage's device per batch, as
Keras' `test_step` does.

```
S = 2 batches of M = 2 micro-batches, K = 2 stages, one call:
    tick     0  1  2  3  4
    stage 0 F0 F1 F2 F3  .
    stage 1  . F0 F1 F2 F3      (F2, F3: the second batch)
```
"""

import keras
import tensorflow as tf

from keras_pipe import _compat, _validation, placed_data
from keras_pipe.distributed import cluster

__all__ = ["InferenceMethods", "AUTO"]

AUTO = "auto"
# "auto": micro-batches per stage in each call's stream, the bubble
# `(K - 1) / (S M + K - 1)` then at most a ninth; this process's work
# between calls (the next batches in, the outputs out) waits for the
# stream's end, so fewer, longer calls hide more of it.
_STREAM_PER_STAGE = 8


def _check_setting(name, value):
    if value == AUTO:
        return value
    _validation.check_positive_int(name, value)
    return value


def _rows(x):
    return tf.shape(next(t for t in keras.tree.flatten(x)
                         if t is not None))[0]


class InferenceMethods:
    """`PipelineModel`'s pipelined `predict`, `evaluate` and validation."""

    @property
    def inference_micro_batches(self):
        """`M` of `predict`, `evaluate` and `fit`'s validation: an int >= 1
        or `"auto"` (default): the training `num_micro_batches`, so that
        a stage holds no larger micro-batch than in training; the stream
        of several batches per call (`inference_steps_per_execution`)
        keeps the stages busy."""
        return getattr(self, "_inference_micro_batches", AUTO)

    @inference_micro_batches.setter
    def inference_micro_batches(self, value):
        self._inference_micro_batches = _check_setting(
            "inference_micro_batches", value)
        self.predict_function = self.test_function = None

    @property
    def inference_steps_per_execution(self):
        """Batches per call of `predict`, `evaluate` and validation, run
        as one stream of micro-batches: an int >= 1 or `"auto"` (default):
        the compiled `steps_per_execution` if it is above 1, else enough
        batches for 8 micro-batches per stage in each call. Callbacks see
        one batch end per call, as with Keras' `steps_per_execution`."""
        return getattr(self, "_inference_steps_per_execution", AUTO)

    @inference_steps_per_execution.setter
    def inference_steps_per_execution(self, value):
        self._inference_steps_per_execution = _check_setting(
            "inference_steps_per_execution", value)
        self.predict_function = self.test_function = None

    def _inference_counts(self):
        """`(M, S)` of an inference call, "auto" resolved."""
        m = self.inference_micro_batches
        if m == AUTO:
            m = self.num_micro_batches
        s = self.inference_steps_per_execution
        if s == AUTO:
            compiled = getattr(self, "steps_per_execution", 1) or 1
            s = compiled if compiled > 1 else -(
                -_STREAM_PER_STAGE * self.num_stages // m)
        return m, s

    def _forward_batches(self, xs):
        """The merged outputs of each batch of `xs`, run as one stream."""
        for x in xs[:1]:
            self._ensure_built(x)
            self._remember_input_spec(x)
        m, _ = self._inference_counts()
        steps = self._executor.forward_batches(xs, m)
        return [self._executor.outputs(step) for step in steps]

    def _make_predict_batches(self, force=False):
        """Sets `predict_function(data)`: `data` a list of batches (as
        Keras' `predict` gives it), the outputs concatenated."""
        if self.predict_function is not None and not force:
            return self.predict_function

        @tf.autograph.experimental.do_not_convert
        def predict_batches(data):
            xs = [keras.utils.unpack_x_y_sample_weight(d)[0] for d in data]
            outputs = self._forward_batches(xs)
            if len(outputs) == 1:
                return outputs[0]
            # Concatenated in this process: each batch's outputs leave the
            # last stage as soon as they are made, while it works on the
            # next batches, instead of all at once after the last.
            with tf.device(cluster.local_cpu()):
                return keras.tree.map_structure(
                    lambda *parts: tf.concat(parts, axis=0), *outputs)

        self.predict_function = tf.function(predict_batches,
                                            reduce_retracing=True)
        return self.predict_function

    def _make_test_batches(self, force=False):
        """Sets `test_function(iterator)`: up to `S` batches per call, one
        stream; the loss and metrics updated per batch."""
        if self.test_function is not None and not force:
            return self.test_function

        @tf.autograph.experimental.do_not_convert
        def test_batches(data):
            unpacked = [keras.utils.unpack_x_y_sample_weight(d)
                        for d in data]
            outputs = self._forward_batches([x for x, _, _ in unpacked])
            logs = None
            for (x, y, sample_weight), y_pred in zip(unpacked, outputs):
                with tf.device(self._resolved_devices[-1]):
                    loss = _compat.compute_loss(
                        self, x=x, y=y, y_pred=y_pred,
                        sample_weight=sample_weight, training=False)
                self._loss_tracker.update_state(loss,
                                                sample_weight=_rows(x))
                logs = self.compute_metrics(x, y, y_pred,
                                            sample_weight=sample_weight)
            return logs

        step = tf.function(test_batches, reduce_retracing=True)
        _, count = self._inference_counts()

        def test_function(iterator):
            data = []
            for _ in range(count):
                try:
                    data.append(next(iterator))
                except (StopIteration, tf.errors.OutOfRangeError):
                    break
            if not data:
                raise StopIteration
            return step(data)

        self.test_function = test_function
        return test_function

    def generate(self, inputs, max_length=None, stop_token_ids="auto",
                 strip_prompt=False, num_micro_batches=None,
                 jit_compile=True):
        """The `generate` of the KerasHub `CausalLM` this pipeline was cut
        from, its decode loop pipelined (`keras_pipe.model.generation`).

        Same arguments and outputs as the task's `generate`; the sampler is
        the pipeline's (`pipe.compile(sampler=...)`), else the task's
        (`task.compile(sampler=...)`). The prompts are cut into
        `num_micro_batches` micro-batches that are on different stages at
        the same time, each stage keeping the key/value cache of its
        layers; the loop over tokens runs in one graph.

        ```python
        pipe = keras_pipe.PipelineModel.from_model(gpt2_lm, num_stages=2,
                                                   devices=devices)
        pipe.compile(sampler="greedy")
        out = pipe.generate(prompts, stop_token_ids=[end_id])
        ```

        Args:
            inputs, max_length, stop_token_ids, strip_prompt: as the
                task's `generate`.
            num_micro_batches: micro-batches of the prompts, at least the
                number of stages that hold decoder layers. Defaults to
                `None`: that number of stages when they are pinned
                `local_workers` (which then share their cores for the
                call: `keras_pipe.distributed.local.cores_shared`), else
                one more.
            jit_compile: compile each stage's layers of a decode tick with
                XLA on the stage's device (the loop across the stages is
                not compiled). Defaults to `True`.

        Returns:
            What the task's `generate` returns.

        Raises:
            TypeError: if the pipeline was not cut from a KerasHub
                `CausalLM`, or `jit_compile` is not a bool.
            ValueError: for too few `num_micro_batches`, or a sampler of
                the task that runs its own loop (beam search).
        """
        from keras_pipe.model import generation  # noqa: PLC0415 (KerasHub only)
        return generation.generate(
            self, inputs, max_length=max_length,
            stop_token_ids=stop_token_ids, strip_prompt=strip_prompt,
            num_micro_batches=num_micro_batches, jit_compile=jit_compile)

    def export_generate(self, filepath, batch_size, sequence_length,
                        num_micro_batches=None, stop_token_ids=None,
                        verbose=None, jit_compile=True):
        """Exports `generate`'s pipelined decode loop as a SavedModel.

        The endpoint `generate` takes `{"token_ids": int32, "padding_mask":
        bool}` of shape `[batch_size, sequence_length]` (the prompts
        right-padded, as the task's preprocessor makes them) and returns
        the same dict, generated to `sequence_length` as the task's
        `generate_step` (no preprocessing, no `strip_prompt`). The
        variables keep their devices (`SAVE_VARIABLE_DEVICES`), so the
        loop runs across the stages where it is loaded: the same devices
        must exist there (the same workers connected). For a model that
        fits one device, export the task itself instead.

        ```python
        pipe.export_generate("decode", batch_size=16, sequence_length=64)
        loaded = tf.saved_model.load("decode")   # same devices
        out = loaded.generate({"token_ids": ids, "padding_mask": mask})
        ```

        Args:
            filepath: where to write the SavedModel.
            batch_size, sequence_length: the static shape of the inputs.
            num_micro_batches: as in `generate`. Defaults to `None`.
            stop_token_ids: token ids that end the loop when every
                sequence has one, baked into the export. Defaults to
                `None`: every sequence runs to `sequence_length`.
            verbose: print the endpoints. Defaults to `None` (True).
            jit_compile: as in `generate`. Defaults to `True`.

        Raises:
            TypeError: if the pipeline was not cut from a KerasHub
                `CausalLM`, a size is not an int, or `jit_compile` is not a
                bool.
            ValueError: for a size below 1, too few `num_micro_batches`,
                or `stop_token_ids` not a list of ints.
        """
        from keras_pipe.model import generation  # noqa: PLC0415 (KerasHub only)
        return generation.export(
            self, filepath, batch_size, sequence_length,
            num_micro_batches=num_micro_batches,
            stop_token_ids=stop_token_ids, verbose=verbose,
            jit_compile=jit_compile)

    def _keras_predict(self, *args, **kwargs):
        """Keras' `predict`, `S` batches per call (`_inference_call`),
        array inputs batched on `data_device` (`keras_pipe.placed_data`)."""
        args, kwargs = placed_data.placed_call(
            "predict", self, self.data_device, args, kwargs)
        return self._inference_call(super().predict, *args, **kwargs)

    def _inference_call(self, method, *args, **kwargs):
        """Keras' `method` run with `S` batches per step function call."""
        _, count = self._inference_counts()
        # fit's validation reads the epoch iterator fit made for it, with
        # the training `steps_per_execution`.
        holders = [self, _compat.eval_epoch_iterator(self)]
        holders = [h for h in holders if h is not None]
        saved = [h.steps_per_execution for h in holders]
        for holder in holders:
            holder.steps_per_execution = count
        try:
            return method(*args, **kwargs)
        finally:
            for holder, value in zip(holders, saved):
                holder.steps_per_execution = value
