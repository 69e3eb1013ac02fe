"""The ```python snippets of the READMEs and the docs pages, and running one.

The snippets are read from the files when the tests are collected, so a
documented flow cannot break silently, and an edited README is tested as it
is. Each snippet runs in a fresh Python process (it may create logical CPU
devices, which must come before TensorFlow starts) with:

* a prelude defining what the prose leaves to the reader or defines in an
  earlier snippet: the imports (`keras`, `keras_pipe`, `np`, `tf`), `x`,
  `y`, `devices`, `other_devices`, `uint8_batch`, and a `cat.jpg` in the
  working directory;
* small substitutions: `num_micro_batches=N` becomes 2, image models get
  32 x 32 inputs, `model.compile(...)` / `model.fit(...)` placeholders get
  a loss and one epoch of random data fitting the model;
* a SavedModel wherever a snippet loads one (`tf.saved_model.load("DIR")`),
  written by the README command that has `--export DIR`. For the examples
  that `tests/test_examples.py` trains and exports anyway (`EXAMPLES`), that
  test runs the snippets on its own export (`serving`); for any other
  command `run` first runs it with `--mock-data --steps 1` (tiny sizes, no
  download).

A snippet that uses a name the prelude does not define fails with a
NameError: define the name in the snippet or add it to `PRELUDE`.

The fresh process is forked from a warm one (`tests/support/warm.py`): a
fresh TensorFlow runtime and Keras state, without importing them again.
"""

import os
import re
import shlex
import textwrap

from tests.support import warm

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__))))
READMES = ("README.md", os.path.join("examples", "README.md"))
# Every page of the documentation site (docs/**/*.md), in a stable order.
DOCS = tuple(sorted(
    os.path.relpath(os.path.join(folder, name), ROOT)
    for folder, _, names in os.walk(os.path.join(ROOT, "docs"))
    for name in names if name.endswith(".md")))
FILES = READMES + DOCS
# The example scripts whose SavedModels tests/test_examples.py exports and
# serves; the snippets loading one run there, on that export.
EXAMPLES = ("examples/imagenet.py", "examples/translate.py")

PRELUDE = textwrap.dedent('''
    import os
    os.environ.setdefault("KERAS_BACKEND", "tensorflow")
    import keras  # noqa: F401  (imports start no TensorFlow runtime)
    import numpy as np
    import tensorflow as tf

    import keras_pipe  # noqa: F401
    _rng = np.random.default_rng(0)

    def _random_data(model, rows=8):
        """Inputs like `model`'s and integer labels for its last axis."""
        import keras
        plain = model.to_model() if hasattr(model, "to_model") else model
        inputs = plain.input

        def shape(t):
            return (rows,) + tuple(d or 4 for d in t.shape[1:])

        def sample(t):
            if "int" in str(t.dtype):
                return _rng.integers(0, 2, shape(t)).astype(str(t.dtype))
            return _rng.random(shape(t)).astype("float32")

        xs = keras.tree.map_structure(sample, inputs)
        # The logits' shape from the model's graph (a predict would trace
        # the pipeline's predict step only to read it).
        logits = shape(keras.tree.flatten(plain.output)[0])
        ys = _rng.integers(0, logits[-1], logits[:-1])
        return xs, ys

    def _compile_args():
        import keras
        return dict(optimizer="sgd", loss=keras.losses.
                    SparseCategoricalCrossentropy(from_logits=True))

    def _fit_args(model):
        xs, ys = _random_data(model)
        return dict(x=xs, y=ys, batch_size=8, epochs=1, verbose=0)

    x = _rng.random((64, 32)).astype("float32")
    y = _rng.integers(0, 10, (64,))
''')

# A tensor starts TensorFlow: only for snippets that create no devices.
IMAGES = textwrap.dedent('''
    uint8_batch = tf.constant(
        _rng.integers(0, 256, (2, 40, 48, 3)).astype("uint8"))
''')

DEVICES = textwrap.dedent('''
    import keras_pipe
    devices = keras_pipe.logical_cpu_devices(4)
    other_devices = devices[2:] + devices[:2]
''')


def blocks(language):
    """`(file, index, code)` of each block fenced as ```language."""
    found = []
    for name in FILES:
        lines = open(os.path.join(ROOT, name), encoding="utf-8").read()
        info, body, k = None, [], 0
        for line in lines.splitlines():
            if line.startswith("```"):
                if info is None:
                    info, body = line[3:].strip(), []
                    continue
                if info == language:
                    found.append((name, k, "\n".join(body) + "\n"))
                    k += 1
                info = None
            elif info is not None:
                body.append(line)
    return found


def shrink(code):
    """The substitutions that make a snippet small and complete."""
    code = re.sub(r"num_micro_batches=\d+", "num_micro_batches=2", code)
    code = re.sub(r"input_shape=\(\d+, \d+, 3\)", "input_shape=(32, 32, 3)",
                  code)
    code = re.sub(r"(\w+)\.compile\(\.\.\.\)",
                  r"\1.compile(**_compile_args())", code)
    code = re.sub(r"(\w+)\.fit\(\.\.\.\)", r"\1.fit(**_fit_args(\1))", code)
    return code


def export_commands():
    """{DIR: argv} for each README command that writes `--export DIR`."""
    commands = {}
    for _, _, block in blocks(""):
        for line in re.sub(r"\\\n\s*", " ", block).splitlines():
            try:
                argv = shlex.split(line, comments=True)
            except ValueError:  # not a command line
                continue
            if argv[:1] == ["python"] and "--export" in argv:
                commands.setdefault(argv[argv.index("--export") + 1], argv)
    return commands


def _env():
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3",
               KERAS_BACKEND="tensorflow")
    env["PYTHONPATH"] = os.pathsep.join(
        [ROOT] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep)
                  if p])
    return env


def _run(argv, cwd, timeout=900):
    """Runs `python *argv` in a child of the warm process."""
    proc = warm.run(argv, _env(), cwd, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]


def _export_saved_models(code, cwd):
    """Writes, with tiny sizes, the SavedModels that `code` loads."""
    commands = export_commands()
    for path in loaded_paths(code):
        if os.path.exists(os.path.join(cwd, path)):
            continue  # Exported by the caller (tests/test_examples.py).
        assert path in commands, (
            f"A snippet loads {path!r}, but no README command writes it "
            f"(--export {path}); commands found: {sorted(commands)}")
        script = os.path.join(ROOT, commands[path][1])
        _run([script, "--mock-data", "--steps", "1",
              "--eval-steps", "1", "--num-stages", "2",
              "--num-micro-batches", "2", "--export", path], cwd)


def _write_jpeg(path):
    import tensorflow as tf  # noqa: PLC0415
    with open(path, "wb") as f:
        f.write(tf.io.encode_jpeg(tf.zeros((20, 30, 3), tf.uint8)).numpy())


def loaded_paths(code):
    """The SavedModel directories `code` loads."""
    return re.findall(r"tf\.saved_model\.load\(\"([^\"]+)\"\)", code)


def serving(example):
    """{DIR: [snippet, ...]}: the snippets loading an export of `example`.

    `example` is a script path as README commands write it, e.g.
    `"examples/imagenet.py"`.
    """
    found = {}
    for path, argv in export_commands().items():
        if argv[1] != example:
            continue
        for _, _, code in SNIPPETS:
            if path in loaded_paths(code):
                found.setdefault(path, []).append(code)
    return found


def run(code, cwd):
    """Runs one snippet, shrunk and with its prelude, in a fresh process."""
    code = shrink(code)
    prelude = PRELUDE
    if "logical_cpu_devices(" not in code:
        prelude += DEVICES
    if "uint8_batch" in code:
        prelude += IMAGES
    _export_saved_models(code, cwd)
    if "cat.jpg" in code:
        _write_jpeg(os.path.join(cwd, "cat.jpg"))
    script = os.path.join(cwd, "snippet.py")
    with open(script, "w", encoding="utf-8") as f:
        f.write(prelude + "\n" + code)
    result = warm.run([script], _env(), cwd)
    assert result.returncode == 0, (result.stdout[-2000:]
                                    + result.stderr[-4000:])


SNIPPETS = blocks("python")
