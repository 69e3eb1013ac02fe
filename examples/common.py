"""What the examples share: pipeline flags, devices, callbacks, throughput.

Both examples build a plain Keras model, cut it with
`keras_pipe.PipelineModel.from_model` and train it with `fit`; nothing here
is specific to one architecture.
"""

import argparse
import os
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import tensorflow as tf  # noqa: E402

import keras_pipe  # noqa: E402
from keras_pipe import _validation  # noqa: E402

REMAT_MODES = _validation.REMAT_MODES
BALANCE_MODES = ("params", "flops", "time", "memory")


def add_pipeline_flags(parser, batch_size, num_stages=4, num_micro_batches=8):
    """Adds the flags both examples take.

    `--batch-size` defaults to `batch_size`, or 8 with `--mock-data`
    (see `resolve_batch_size`).
    """
    group = parser.add_argument_group("pipeline")
    group.add_argument("--num-stages", type=int, default=num_stages,
                       help="pipeline stages, one device each")
    group.add_argument("--num-micro-batches", type=int,
                       default=num_micro_batches,
                       help="micro-batches per mini-batch (GPipe's M)")
    group.add_argument("--remat", default="except_last", choices=REMAT_MODES,
                       help="which micro-batches recompute activations")
    group.add_argument("--balance", default="params", type=parse_balance,
                       help=f"one of {', '.join(BALANCE_MODES)}, or layer "
                       "counts per stage, e.g. 40,35,30,31")
    group.add_argument("--devices", default="auto",
                       help="comma-separated TF devices, one per stage; "
                       "'auto': one GPU per stage, else logical CPU devices")
    group = parser.add_argument_group("training")
    group.add_argument("--batch-size", type=int, default=None,
                       help=f"mini-batch size (default {batch_size}, 8 with "
                       "--mock-data)")
    parser.set_defaults(default_batch_size=batch_size)
    group.add_argument("--epochs", type=int, default=1)
    group.add_argument("--steps", type=int, default=None,
                       help="training steps per epoch (default: one pass "
                       "over the training split)")
    group.add_argument("--eval-steps", type=int, default=None,
                       help="evaluation batches (default: whole split)")
    group.add_argument("--model-dir", default=None,
                       help="TensorBoard logs and checkpoints go here")
    group.add_argument("--export", default=None, metavar="DIR",
                       help="write a SavedModel for serving to DIR")
    group.add_argument("--mock-data", action="store_true",
                       help="tfds.testing.mock_data and tiny sizes: runs "
                       "offline in seconds")
    group.add_argument("--data-dir", default=None,
                       help="TFDS data directory (manual downloads too)")
    group.add_argument("--seed", type=int, default=0)


def resolve_batch_size(args):
    """The given --batch-size, else the example's default (8 on mock data)."""
    if args.batch_size is None:
        args.batch_size = 8 if args.mock_data else args.default_batch_size
    return args.batch_size


def parse_balance(text):
    """`"params"` stays a mode; `"3,4,5"` becomes `[3, 4, 5]`."""
    if text in BALANCE_MODES:
        return text
    try:
        return [int(part) for part in text.split(",")]
    except ValueError as exc:
        raise argparse.ArgumentTypeError(
            f"--balance must be one of {BALANCE_MODES} or comma-separated "
            f"layer counts, e.g. 10,12,9. Received: {text!r}") from exc


def load(args, loader):
    """`loader(args)`, on `tfds.testing.mock_data` with `--mock-data`."""
    if not args.mock_data:
        return loader(args)
    import tensorflow_datasets as tfds

    with tfds.testing.mock_data(num_examples=4 * args.batch_size):
        return loader(args)


def setup_devices(args):
    """One device per stage; must run before TensorFlow makes a tensor.

    Without enough GPUs the host CPU is split into logical CPU devices:
    they run the same program (placement, schedule, send/receive between
    stages) but share the host's cores, so they show correctness, not
    speed-up.
    """


    if args.devices != "auto":
        devices = args.devices.split(",")
        if len(devices) != args.num_stages:
            raise SystemExit(
                f"--devices names {len(devices)} devices for "
                f"--num-stages={args.num_stages}: give one per stage.")
        return devices
    gpus = tf.config.list_physical_devices("GPU")
    if len(gpus) >= args.num_stages:
        return [f"/device:GPU:{j}" for j in range(args.num_stages)]
    return keras_pipe.logical_cpu_devices(args.num_stages)


def make_pipeline(model, args, devices):
    """Cuts `model` into `args.num_stages` stages with `from_model`."""
    return keras_pipe.PipelineModel.from_model(
        model, num_stages=args.num_stages, devices=devices,
        num_micro_batches=args.num_micro_batches, remat=args.remat,
        balance=args.balance)


def make_callbacks(args, throughput):
    """Progress bar (fit's own), TensorBoard, checkpoints, throughput."""
    callbacks = [throughput]
    if args.model_dir:
        callbacks.append(keras.callbacks.TensorBoard(
            os.path.join(args.model_dir, "logs"), write_graph=False))
        callbacks.append(keras.callbacks.ModelCheckpoint(
            os.path.join(args.model_dir, "ckpt-{epoch:03d}.weights.h5"),
            save_weights_only=True))
    return callbacks


class Throughput(keras.callbacks.Callback):
    """Examples per second of training steps, after `skip` warm-up steps.

    The first step traces and builds the pipeline's graph: it is left out.
    """

    def __init__(self, batch_size, skip=1):
        super().__init__()
        self.batch_size = batch_size
        self.skip = skip
        self.durations = []
        self._start = None
        self._seen = 0

    def on_train_batch_begin(self, batch, logs=None):
        self._start = time.perf_counter()

    def on_train_batch_end(self, batch, logs=None):
        self._seen += 1
        if self._seen > self.skip:
            self.durations.append(time.perf_counter() - self._start)

    @property
    def examples_per_second(self):
        if not self.durations:
            return None
        return self.batch_size * len(self.durations) / sum(self.durations)

    def on_train_end(self, logs=None):
        rate = self.examples_per_second
        if rate is not None:
            print(f"throughput: {rate:.1f} examples/s over "
                  f"{len(self.durations)} steps (first {self.skip} left out)")


def boundaries(pipe):
    """Per cut, the names of the layers whose outputs cross it."""
    cuts = []
    for stage in pipe.stages[:-1]:
        names = [x._keras_history.operation.name
                 for x in getattr(stage, "output_tensors", [])]
        cuts.append(names)
    return cuts


def describe(pipe, args, devices):
    """Prints the cut, what crosses each boundary, and the schedule."""
    print(pipe.summary_table())
    for j, names in enumerate(boundaries(pipe)):
        print(f"stage {j} -> {j + 1} sends the outputs of: {', '.join(names)}")
    bubble = keras_pipe.engine.schedule.bubble_fraction(args.num_micro_batches,
                                                 args.num_stages)
    print(f"devices: {', '.join(devices)}; num_micro_batches="
          f"{args.num_micro_batches}, remat={args.remat!r}, bubble "
          f"{bubble:.0%}")
