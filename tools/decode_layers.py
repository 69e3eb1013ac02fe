"""Probe: the CPU of decode steps through KerasHub decoder layers, by rows.

    python tools/decode_layers.py gpt2 4   # tools.benchmarks.generation's
                                           # GPT-2, its first 4 layers

One process pinned to one core (intra-op 1): a `tf.while_loop` of 56 decode
steps through the first N decoder layers of the benchmark's model, each
with its own key/value cache of 64 positions, weights read once: 16 rows
in one call per layer, 2 micro-batches of 8 rows (what one stage of the
pipeline does per round at M=2), and 8 rows once. CPU seconds per round.
"""

import os
import resource
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
os.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[-1]})
import keras  # noqa: E402
import tensorflow as tf  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(
    __file__))))
from tools.benchmarks import generation  # noqa: E402

tf.config.threading.set_intra_op_parallelism_threads(1)
tf.config.threading.set_inter_op_parallelism_threads(2)
STEPS = 56


def cpu():
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def main(model, num_layers):
    task = generation._task(model)
    layers = task.backbone.transformer_layers[:num_layers]
    dims = [4, 64] if model == "llama" else [8, 64]
    for mbs, rows in [(1, 16), (2, 8), (1, 8)]:
        caches0 = [[tf.zeros([rows, 2, 64, *dims]) for _ in layers]
                   for _ in range(mbs)]
        xs0 = [tf.random.normal([rows, 1, 512]) for _ in range(mbs)]

        @tf.function
        def loop(xs, caches, mbs=mbs):
            mapping = [(v, tf.identity(v.value)) for layer in layers
                       for v in layer.weights]

            def body(i, xs, caches):
                xs, caches = list(xs), [list(c) for c in caches]
                for b in range(mbs):
                    x = xs[b]
                    for n, layer in enumerate(layers):
                        with keras.StatelessScope(state_mapping=mapping):
                            x, caches[b][n] = layer(
                                x, self_attention_cache=caches[b][n],
                                self_attention_cache_update_index=i + 4)
                    xs[b] = x * 0.5
                return i + 1, xs, caches
            return tf.while_loop(lambda i, x, c: i < STEPS, body,
                                 (0, xs, caches))

        loop(xs0, caches0)
        best = min(_timed(loop, xs0, caches0) for _ in range(3))
        print(f"{model}, {num_layers} layers, {mbs} x {rows} rows: "
              f"{best / STEPS * 1e3:.2f} ms CPU per round", flush=True)


def _timed(loop, xs, caches):
    start = cpu()
    loop(xs, caches)
    return cpu() - start


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))
