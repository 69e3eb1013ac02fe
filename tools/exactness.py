"""How far one pipelined training step is from the unsplit model's step.

Runs one SGD step on a `keras.applications` model (eagerly, one device) and
the same step through `PipelineModel.from_model` for several
`num_micro_batches`, from the same weights, and prints the largest
difference of the loss, of the trainable weights and of the
BatchNormalization moving statistics. With BatchNormalization and `M > 1`
each micro-batch is normalized with its own statistics (as in GPipe), so the
step differs by design; `--deferred` swaps in
`keras_pipe.layers.DeferredBatchNormalization` (moving statistics from the
whole mini-batch).

```
python tools/exactness.py --model MobileNetV2 --image-size 64
```
"""

import argparse
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(
    __file__))))


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="MobileNetV2",
                        help="a keras.applications constructor")
    parser.add_argument("--image-size", type=int, default=64)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--num-stages", type=int, default=2)
    parser.add_argument("--micro-batches", default="1,2,4",
                        help="comma-separated values of num_micro_batches")
    parser.add_argument("--deferred", action="store_true",
                        help="DeferredBatchNormalization instead of BN")
    return parser.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    import keras_pipe  # noqa: PLC0415
    devices = keras_pipe.logical_cpu_devices(args.num_stages)
    import keras  # noqa: PLC0415
    import numpy as np  # noqa: PLC0415

    keras.utils.set_random_seed(0)
    model = getattr(keras.applications, args.model)(
        weights=None, input_shape=(args.image_size, args.image_size, 3),
        classes=5, classifier_activation=None)
    # The reference is the unsplit model with stock BatchNormalization; with
    # --deferred the pipeline runs a copy whose BatchNormalization layers are
    # deferred (same weights, same order).
    net = keras_pipe.layers.defer_batch_norm(model) if args.deferred else model
    rng = np.random.default_rng(0)
    x = rng.random((args.batch_size, args.image_size, args.image_size, 3),
                   dtype=np.float32)
    y = rng.integers(0, 5, (args.batch_size,))
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    start = [v.numpy() for v in model.weights]
    # Deferred layers keep their names, so the variables match by path;
    # their extra accumulators are left out.
    by_path = {v.path: v for v in net.weights}
    net_weights = [by_path[v.path] for v in model.weights]

    def step(trained, weights, **kwargs):
        trained.compile(keras.optimizers.SGD(0.1), loss=loss,
                        jit_compile=False, **kwargs)
        value = trained.train_on_batch(x, y, return_dict=True)["loss"]
        result = [v.numpy() for v in weights]
        for v, s in zip(list(model.weights) + net_weights, start + start):
            v.assign(s)
        return value, result

    ref_loss, ref = step(model, model.weights, run_eagerly=True)
    trainable = [i for i, v in enumerate(model.weights) if v.trainable]
    moving = [i for i, v in enumerate(model.weights) if not v.trainable]
    print(f"{args.model} {args.image_size}px, batch {args.batch_size}, "
          f"K={args.num_stages}, "
          f"{'Deferred' if args.deferred else ''}BatchNormalization")
    print("M  |loss diff|  max |weight diff|  max |moving stat diff|")
    for m in [int(v) for v in args.micro_batches.split(",")]:
        pipe = keras_pipe.PipelineModel.from_model(
            net, args.num_stages, devices=devices, num_micro_batches=m,
            balance="params", schedule="gpipe")
        value, got = step(pipe, net_weights)

        def worst(indices, got=got):
            return max((float(np.max(np.abs(got[i] - ref[i])))
                        for i in indices), default=0.0)

        print(f"{m}  {abs(value - ref_loss):.2e}  {worst(trainable):.2e}  "
              f"{worst(moving):.2e}")


if __name__ == "__main__":
    main()
