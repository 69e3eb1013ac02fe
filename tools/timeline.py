"""Draws the timeline of one training step of the demo pipeline.

    python tools/timeline.py [--num-stages 4] [--num-micro-batches 8]
                             [--schedule NAME] [--num-devices D]
                             [--out docs/images] [--name timeline]

Runs the demo's model (`keras_pipe.demo`) through `fit` with the
`keras_pipe.callbacks.Timeline` callback and writes `NAME.png` and
`NAME.trace.json` (chrome://tracing) to `--out` (`--name`, default
`timeline`). Without GPUs the
stages run on logical CPU devices, which share the machine's cores: the
picture shows the schedule, not a speed-up. Called from a process that
already has enough logical CPU devices (a test, a notebook), `main` uses
the first of them. Schedules that run several
stages per device (`interleaved_1f1b`, `zbv`) get `--num-devices` devices
(default: half the stages for them, else one per stage), in the order the
schedule needs.
"""

import argparse
import os
import shutil
import sys
import tempfile

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")


def _logical_devices(num_devices):
    """`num_devices` logical CPU devices: made here, or the first of those
    this process already has."""
    import tensorflow as tf

    import keras_pipe
    try:
        return keras_pipe.logical_cpu_devices(num_devices)
    except RuntimeError:
        if len(tf.config.list_logical_devices("CPU")) < num_devices:
            raise
        return [f"/device:CPU:{k}" for k in range(num_devices)]


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--num-stages", type=int, default=4)
    parser.add_argument("--num-micro-batches", type=int, default=8)
    parser.add_argument("--remat", default="except_last")
    parser.add_argument("--schedule", default="gpipe")
    parser.add_argument("--num-devices", type=int, default=None)
    parser.add_argument("--batch-size", type=int, default=512)
    parser.add_argument("--out", default="timeline_out")
    parser.add_argument("--name", default="timeline")
    args = parser.parse_args(argv)

    import keras_pipe
    from keras_pipe import demo
    from keras_pipe.engine import schedule as schedule_lib

    entry = schedule_lib.get_schedule(args.schedule)
    num_devices = args.num_devices
    if num_devices is None:
        num_devices = (args.num_stages // 2 if entry.placement
                       else args.num_stages)
    logical = _logical_devices(num_devices)
    devices = [logical[d] for d in schedule_lib.stage_placement(
        args.num_stages, num_devices, entry.placement or "loop")]
    import keras

    keras.utils.set_random_seed(0)
    x, y = demo.make_data(4 * args.batch_size, seed=0)
    model = keras_pipe.PipelineModel(
        demo.make_stages(args.num_stages, width=256), devices=devices,
        num_micro_batches=args.num_micro_batches, remat=args.remat,
        schedule=args.schedule)
    model.compile("adam", keras.losses.SparseCategoricalCrossentropy(
        from_logits=True))
    with tempfile.TemporaryDirectory() as logdir:
        # Step 2 runs the freshly traced recording function (first-run
        # costs); step 3 runs it again, warm: that one is drawn.
        timeline = keras_pipe.callbacks.Timeline(logdir, steps=(2, 3))
        model.fit(x, y, batch_size=args.batch_size, epochs=1, verbose=0,
                  callbacks=[timeline])
        os.makedirs(args.out, exist_ok=True)
        shutil.copy(os.path.join(logdir, "step3.png"),
                    os.path.join(args.out, args.name + ".png"))
        shutil.copy(os.path.join(logdir, "step3.trace.json"),
                    os.path.join(args.out, args.name + ".trace.json"))
    result = timeline.results[-1]
    print(f"measured bubble {result['measured_bubble']:.1%}, GPipe "
          f"(K-1)/(M+K-1) = {result['theoretical_bubble']:.1%}; wrote "
          f"{args.out}/{args.name}.png")


if __name__ == "__main__":
    sys.exit(main())
