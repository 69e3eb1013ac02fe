"""What the examples share: pipeline flags, devices, callbacks, throughput.

Both examples build a plain Keras model, cut it with
`keras_pipe.PipelineModel.from_model` and train it with `fit`; nothing here
is specific to one architecture.
"""

import argparse
import os
import time

REMAT_MODES = ("always", "except_last", "never")
BALANCE_MODES = ("params", "flops", "time", "memory")


def add_pipeline_flags(parser, batch_size, num_stages=4, num_micro_batches=8):
    """Adds the flags both examples take."""
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
    group.add_argument("--batch-size", type=int, default=batch_size)
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


def setup_devices(args):
    """One device per stage; must run before TensorFlow makes a tensor.

    Without enough GPUs the host CPU is split into logical CPU devices:
    they run the same program (placement, schedule, send/receive between
    stages) but share the host's cores, so they show correctness, not
    speed-up.
    """
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import tensorflow as tf

    import keras_pipe

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
    import keras_pipe

    return keras_pipe.PipelineModel.from_model(
        model, num_stages=args.num_stages, devices=devices,
        num_micro_batches=args.num_micro_batches, remat=args.remat,
        balance=args.balance)


def make_callbacks(args, throughput):
    """Progress bar (fit's own), TensorBoard, checkpoints, throughput."""
    import keras

    callbacks = [throughput]
    if args.model_dir:
        callbacks.append(keras.callbacks.TensorBoard(
            os.path.join(args.model_dir, "logs"), write_graph=False))
        callbacks.append(keras.callbacks.ModelCheckpoint(
            os.path.join(args.model_dir, "ckpt-{epoch:03d}.weights.h5"),
            save_weights_only=True))
    return callbacks


def throughput_callback(batch_size, skip=1):
    """A callback measuring examples per second after `skip` warm-up steps."""
    import keras

    class Throughput(keras.callbacks.Callback):
        """Times training steps; the first `skip` ones trace and are left out."""

        def __init__(self):
            super().__init__()
            self.durations = []
            self._start = None
            self._seen = 0

        def on_train_batch_begin(self, batch, logs=None):
            self._start = time.perf_counter()

        def on_train_batch_end(self, batch, logs=None):
            self._seen += 1
            if self._seen > skip:
                self.durations.append(time.perf_counter() - self._start)

        @property
        def examples_per_second(self):
            if not self.durations:
                return None
            return batch_size * len(self.durations) / sum(self.durations)

        def on_train_end(self, logs=None):
            rate = self.examples_per_second
            if rate is not None:
                print(f"throughput: {rate:.1f} examples/s over "
                      f"{len(self.durations)} steps (first {skip} left out)")

    return Throughput()


def describe(pipe, args, devices):
    """Prints the cut, the devices and the schedule."""
    import keras_pipe

    print(pipe.summary_table())
    print(f"devices: {', '.join(devices)}; num_micro_batches="
          f"{args.num_micro_batches}, remat={args.remat!r}, bubble "
          f"{keras_pipe.schedule.bubble_fraction(args.num_micro_batches, args.num_stages):.0%}")
