"""The examples run end to end offline, and their SavedModels serve elsewhere.

Each example trains two steps on `tfds.testing.mock_data` with tiny sizes in
a child of a warm process (it needs its own logical CPU devices,
`tests/support/warm.py`), evaluates, exports, and
a second, fresh process loads the SavedModel and calls its signature: no
keras_pipe, no example code and one CPU device there. The example's serving
snippets of examples/README.md then run on the same export
(`tests/support/snippets.py`).
"""

import argparse
import os
import subprocess
import sys

import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLES = os.path.join(ROOT, "examples")
sys.path.insert(0, EXAMPLES)

import common  # noqa: E402

from tests.support import snippets, warm  # noqa: E402

pytestmark = pytest.mark.slow  # the fast tier: `-m "not slow"`


def _env():
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3",
               KERAS_BACKEND="tensorflow")
    env.pop("CUDA_VISIBLE_DEVICES", None)
    return env


def _run(args, cwd, timeout=240):
    """Runs `python *args`; a fresh interpreter for the serving scripts
    (no keras_pipe there), a child of the warm process for an example."""
    if args[0] == "-c":
        result = subprocess.run([sys.executable] + args, cwd=cwd, env=_env(),
                                capture_output=True, text=True,
                                timeout=timeout)
    else:
        result = warm.run(args, warm.env(), cwd=cwd, timeout=timeout)
    assert result.returncode == 0, (result.stdout[-3000:]
                                    + result.stderr[-5000:])
    return result.stdout


SERVE_IMAGES = """
import sys
import numpy as np
import tensorflow as tf
loaded = tf.saved_model.load(sys.argv[1])
images = np.random.default_rng(0).integers(0, 256, (2, 50, 40, 3), np.uint8)
probs = loaded.signatures["serving_default"](images=tf.constant(images))
png = [tf.io.encode_png(image).numpy() for image in images]
probs_png = loaded.signatures["classify_jpeg"](jpeg=tf.constant(png))
jpeg = tf.io.encode_jpeg(images[0]).numpy()
probs_jpeg = loaded.signatures["classify_jpeg"](jpeg=tf.constant([jpeg]))
np.save(sys.argv[2], np.stack([probs["probabilities"].numpy(),
                               probs_png["probabilities"].numpy(),
                               np.repeat(probs_jpeg["probabilities"], 2, 0)]))
print(sorted(loaded.signatures))
"""

SERVE_TEXT = """
import sys
import tensorflow as tf
import tensorflow_text  # noqa: F401  (registers the tokenizer's ops)
loaded = tf.saved_model.load(sys.argv[1])
out = loaded.signatures["serving_default"](
    source=tf.constant(["gebc ahg", "d a gegbf", ""]))["translation"]
print(out.dtype.name, out.shape.as_list(), sorted(loaded.signatures))
"""


def _readme_export(example, tmp_path):
    """Where the README's serving snippets load `example`'s export from."""
    served = snippets.serving(example)
    assert len(served) == 1, served  # One SavedModel per example.
    return str(tmp_path / next(iter(served)))


def _run_serving_snippets(example, tmp_path):
    for codes in snippets.serving(example).values():
        for code in codes:
            snippets.run(code, str(tmp_path))


def test_imagenet_example_trains_exports_and_serves(tmp_path):
    export = _readme_export("examples/imagenet.py", tmp_path)
    out = _run([os.path.join(EXAMPLES, "imagenet.py"), "--mock-data",
                "--steps", "2", "--num-stages", "2",
                "--num-micro-batches", "2", "--export", export,
                "--model-dir", str(tmp_path / "run")], cwd=tmp_path)
    assert "amoebanet_d_1_16_stage1" in out
    assert "stage 0 -> 1 sends the outputs of: cell1_normal1" in out
    assert "evaluation: loss=" in out and "top5=" in out
    assert "throughput: " in out
    assert os.path.exists(tmp_path / "run" / "ckpt-001.weights.h5")
    assert os.listdir(tmp_path / "run" / "logs" / "train")

    probs_file = str(tmp_path / "probs.npy")
    out = _run(["-c", SERVE_IMAGES, export, probs_file], cwd=tmp_path)
    assert "['classify_jpeg', 'serving_default']" in out
    batch, png, jpeg = np.load(probs_file)
    assert batch.shape == (2, 1000)  # imagenet2012's classes.
    np.testing.assert_allclose(batch.sum(axis=1), 1.0, atol=1e-5)
    # A PNG of the same pixels gives the same answer as the raw batch; JPEG
    # is lossy.
    np.testing.assert_allclose(png, batch, atol=1e-6)
    np.testing.assert_allclose(jpeg[0], batch[0], atol=1e-2)
    _run_serving_snippets("examples/imagenet.py", tmp_path)


def test_translate_example_trains_exports_and_serves(tmp_path):
    export = _readme_export("examples/translate.py", tmp_path)
    out = _run([os.path.join(EXAMPLES, "translate.py"), "--mock-data",
                "--steps", "2", "--num-stages", "3",
                "--num-micro-batches", "2", "--export", export,
                "--balance", "params"], cwd=tmp_path)
    # The cut inside the decoder carries the encoder output and its mask.
    cut = next(line for line in out.splitlines()
               if line.startswith("stage 1 -> 2 sends"))
    assert "encoder_norm" in cut and "source_mask" in cut
    assert "WordPiece vocabulary: " in out
    assert "BLEU (greedy, wmt14_translate/de-en validation): " in out
    out = _run(["-c", SERVE_TEXT, export], cwd=tmp_path)
    assert "string [3] ['serving_default']" in out
    _run_serving_snippets("examples/translate.py", tmp_path)


def test_balance_flag():
    assert common.parse_balance("flops") == "flops"
    assert common.parse_balance("3,4,5") == [3, 4, 5]
    with pytest.raises(argparse.ArgumentTypeError,
                       match="--balance must be one of"):
        common.parse_balance("fast")
