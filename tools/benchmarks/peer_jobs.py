"""The three jobs of the peer comparison, built alike in Keras and in torch.

A job is a JSON-able dict: an MLP (`"mlp"`), a stack of pre-norm Transformer
encoder blocks (`"transformer"`) and a stack of residual convolution blocks
on 32x32 images (`"conv"`). Each is a list of units (a Dense layer, a block)
cut into `num_stages` consecutive stages, the same cut in both frameworks;
`flops_per_step` counts the multiply-adds of one training step (forward and
both backward products, 3x the forward) from the shapes, and
`parameter_count` the weights, to check that both frameworks build the
same job.
"""

# Layouts of the K=4 schedules: the worker of each stage.
FOUR_STAGE_LAYOUTS = {"interleaved_1f1b": (0, 1, 0, 1), "zbv": (0, 1, 1, 0)}


def jobs(quick=False):
    """The jobs by name; `quick`: smaller sizes for a fast check."""
    if quick:
        return {
            "mlp": {"kind": "mlp", "layers": 8, "width": 256, "batch": 128,
                    "lr": 1e-3},
            "transformer": {"kind": "transformer", "blocks": 4, "d": 64,
                            "heads": 4, "ffn": 256, "tokens": 16,
                            "batch": 16, "lr": 1e-3},
            "conv": {"kind": "conv", "blocks": 4, "channels": 8, "size": 16,
                     "classes": 10, "batch": 16, "lr": 1e-3}}
    return {
        "mlp": {"kind": "mlp", "layers": 8, "width": 1024, "batch": 512,
                "lr": 1e-3},
        # Reduced from d=512, 8 heads, 128 tokens (about 8x the FLOPs of
        # the MLP's step per step: too slow for one run on a shared host).
        "transformer": {"kind": "transformer", "blocks": 8, "d": 256,
                        "heads": 4, "ffn": 1024, "tokens": 64, "batch": 32,
                        "lr": 1e-3},
        # 4 blocks, not 8: with 8 (2.0-2.2 s of CPU per keras one-core
        # step, 1.4 s torch's) the job's 18 + 2 x 12 configurations took
        # about as long as the Transformer's (26 min), past the run's cap.
        "conv": {"kind": "conv", "blocks": 4, "channels": 32, "size": 32,
                 "classes": 10, "batch": 64, "lr": 1e-3}}


def describe(job):
    """One line naming the job's sizes."""
    kind = job["kind"]
    if kind == "mlp":
        return (f"MLP {job['layers']} x Dense({job['width']}), batch "
                f"{job['batch']}, SGD, MSE")
    if kind == "transformer":
        return (f"Transformer {job['blocks']} pre-norm blocks, d={job['d']}, "
                f"{job['heads']} heads, FFN {job['ffn']}, {job['tokens']} "
                f"tokens, batch {job['batch']}, SGD, MSE")
    return (f"Conv {job['blocks']} residual blocks of 2 x Conv3x3("
            f"{job['channels']}), {job['size']}x{job['size']}x3 images, "
            f"batch {job['batch']}, SGD, cross-entropy")


def num_units(job):
    """The units the stages are cut from: layers or blocks."""
    return job["layers"] if job["kind"] == "mlp" else job["blocks"]


def stage_units(job, num_stages):
    """`[(first, stop), ...]`: each stage's units, as equal as they come."""
    n = num_units(job)
    if n % num_stages:
        raise ValueError(f"The job's {n} units do not cut into "
                         f"num_stages={num_stages} equal stages; pick a "
                         f"count of units divisible by {num_stages}.")
    per = n // num_stages
    return [(j * per, (j + 1) * per) for j in range(num_stages)]


def parameter_count(job):
    """Weights and biases of the job's model, from its shapes."""
    kind = job["kind"]
    if kind == "mlp":
        w = job["width"]
        return job["layers"] * (w * w + w)
    if kind == "transformer":
        d, f = job["d"], job["ffn"]
        block = 4 * (d * d + d) + 2 * 2 * d + (d * f + f) + (f * d + d)
        return job["blocks"] * block
    c, k = job["channels"], job["classes"]
    return ((9 * 3 * c + c) + job["blocks"] * 2 * (9 * c * c + c)
            + (c * k + k))


def flops_per_step(job):
    """FLOPs (2 per multiply-add) of the matmuls/convolutions of one step.

    Forward products, then the backward's input- and weight-gradient
    products: 3x the forward, counting the first layer's input gradient,
    which neither framework computes for data (a bound, within 1/(3 x the
    number of units) of the products run). Element-wise ops, softmax and
    normalization are not counted.
    """
    kind, b = job["kind"], job["batch"]
    if kind == "mlp":
        forward = 2 * b * job["width"] ** 2 * job["layers"]
    elif kind == "transformer":
        d, f, t = job["d"], job["ffn"], job["tokens"]
        per_token = 2 * (4 * d * d + 2 * d * f)  # q, k, v, out; FFN
        attention = 2 * 2 * t * t * d  # scores and weighted sum
        forward = job["blocks"] * b * (t * per_token + attention)
    else:
        c, s = job["channels"], job["size"]
        pixels = b * s * s
        forward = (2 * pixels * 9 * 3 * c
                   + job["blocks"] * 2 * 2 * pixels * 9 * c * c
                   + 2 * b * c * job["classes"])
    return 3 * forward


def data(np, job, rows):
    """Inputs and targets of `rows` examples (seeded; numpy, channels last)."""
    rng = np.random.default_rng(0)
    kind = job["kind"]
    if kind == "mlp":
        shape = (rows, job["width"])
        return (rng.normal(size=shape).astype("float32"),
                rng.normal(size=shape).astype("float32"))
    if kind == "transformer":
        shape = (rows, job["tokens"], job["d"])
        return (rng.normal(size=shape).astype("float32"),
                rng.normal(size=shape).astype("float32"))
    x = rng.normal(size=(rows, job["size"], job["size"], 3)).astype(
        "float32")
    return x, rng.integers(0, job["classes"], size=(rows,)).astype("int64")


def input_shape(job):
    """The input shape without the batch dimension (channels last)."""
    if job["kind"] == "mlp":
        return (job["width"],)
    if job["kind"] == "transformer":
        return (job["tokens"], job["d"])
    return (job["size"], job["size"], 3)


# ------------------------------------------------------------------ Keras


def keras_units(keras, job):
    """The job's units as Keras layers (the conv job: stem and head added
    to the first and last unit)."""
    kind = job["kind"]
    if kind == "mlp":
        n = job["layers"]
        return [[keras.layers.Dense(job["width"], activation=None if
                                    i == n - 1 else "relu")]
                for i in range(n)]
    if kind == "transformer":
        block = _keras_block(keras)
        return [[block(job["d"], job["heads"], job["ffn"])]
                for _ in range(job["blocks"])]
    residual = _keras_residual(keras)
    c = job["channels"]
    units = [[residual(c)] for _ in range(job["blocks"])]
    units[0].insert(0, keras.layers.Conv2D(c, 3, padding="same",
                                           activation="relu"))
    units[-1] += [keras.layers.GlobalAveragePooling2D(),
                  keras.layers.Dense(job["classes"])]
    return units


def keras_stages(keras, job, num_stages):
    """The job as `num_stages` `keras.Sequential` stages."""
    units = keras_units(keras, job)
    return [keras.Sequential([layer for unit in units[a:b] for layer in unit],
                             name=f"stage{j}")
            for j, (a, b) in enumerate(stage_units(job, num_stages))]


def keras_pipeline(keras, keras_pipe, job, config, devices):
    """The job as a built `PipelineModel` for `config` (`"schedule:M"`) on
    two workers' `devices`: 2 stages, or 4 in the schedule's layout
    (`FOUR_STAGE_LAYOUTS`), remat never, seeded."""
    schedule, m = config.split(":")
    order = FOUR_STAGE_LAYOUTS.get(schedule, (0, 1))
    keras.utils.set_random_seed(0)
    model = keras_pipe.PipelineModel(
        keras_stages(keras, job, len(order)),
        devices=[devices[w] for w in order],
        num_micro_batches=int(m), schedule=schedule, remat="never")
    model.build((None, *input_shape(job)))
    return model


def keras_loss(keras, job):
    if job["kind"] == "conv":
        return keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    return "mse"


def _keras_block(keras):
    class PreNormBlock(keras.layers.Layer):
        """x + attention(norm(x)); then + FFN(norm(x)), as torch's
        `TransformerEncoderLayer(norm_first=True)` without dropout."""

        def __init__(self, d, heads, ffn, **kwargs):
            super().__init__(**kwargs)
            self.norm1 = keras.layers.LayerNormalization(epsilon=1e-5)
            self.attention = keras.layers.MultiHeadAttention(heads,
                                                             d // heads)
            self.norm2 = keras.layers.LayerNormalization(epsilon=1e-5)
            self.ff1 = keras.layers.Dense(ffn, activation="relu")
            self.ff2 = keras.layers.Dense(d)

        def build(self, shape):
            self.norm1.build(shape)
            self.attention.build(shape, shape)
            self.norm2.build(shape)
            self.ff1.build(shape)
            self.ff2.build(shape[:-1] + (self.ff1.units,))

        def call(self, x):
            h = self.norm1(x)
            x = x + self.attention(h, h)
            return x + self.ff2(self.ff1(self.norm2(x)))

        def compute_output_shape(self, shape):
            return shape

    return PreNormBlock


def _keras_residual(keras):
    class Residual(keras.layers.Layer):
        """relu(x + conv(relu(conv(x)))), 3x3 convolutions, same padding."""

        def __init__(self, channels, **kwargs):
            super().__init__(**kwargs)
            self.conv1 = keras.layers.Conv2D(channels, 3, padding="same",
                                             activation="relu")
            self.conv2 = keras.layers.Conv2D(channels, 3, padding="same")

        def build(self, shape):
            self.conv1.build(shape)
            self.conv2.build(shape[:-1] + (self.conv1.filters,))

        def call(self, x):
            return keras.ops.relu(x + self.conv2(self.conv1(x)))

        def compute_output_shape(self, shape):
            return shape

    return Residual


# ------------------------------------------------------------------ torch


def torch_units(torch, job):
    """The job's units as torch modules, the same as `keras_units`."""
    nn, kind = torch.nn, job["kind"]
    if kind == "mlp":
        n, w = job["layers"], job["width"]
        return [nn.Sequential(nn.Linear(w, w), *([] if i == n - 1 else
                                                 [nn.ReLU()]))
                for i in range(n)]
    if kind == "transformer":
        return [nn.TransformerEncoderLayer(
            job["d"], job["heads"], job["ffn"], dropout=0.0,
            activation="relu", batch_first=True, norm_first=True,
            layer_norm_eps=1e-5) for _ in range(job["blocks"])]

    class Residual(nn.Module):
        def __init__(self, c):
            super().__init__()
            self.conv1 = nn.Conv2d(c, c, 3, padding=1)
            self.conv2 = nn.Conv2d(c, c, 3, padding=1)

        def forward(self, x):
            return torch.relu(x + self.conv2(torch.relu(self.conv1(x))))

    c = job["channels"]
    units = [Residual(c) for _ in range(job["blocks"])]
    units[0] = nn.Sequential(nn.Conv2d(3, c, 3, padding=1), nn.ReLU(),
                             units[0])
    units[-1] = nn.Sequential(units[-1], nn.AdaptiveAvgPool2d(1),
                              nn.Flatten(), nn.Linear(c, job["classes"]))
    return units


def torch_stages(torch, job, num_stages):
    """The job as `num_stages` `torch.nn.Sequential` stages (seeded)."""
    torch.manual_seed(0)
    units = torch_units(torch, job)
    return [torch.nn.Sequential(*units[a:b])
            for a, b in stage_units(job, num_stages)]


def torch_loss(torch, job):
    if job["kind"] == "conv":
        return torch.nn.functional.cross_entropy
    return torch.nn.functional.mse_loss


def torch_data(torch, np, job, rows):
    """`data` as torch tensors, images channels first."""
    x, y = data(np, job, rows)
    x = torch.from_numpy(x)
    if job["kind"] == "conv":
        x = x.permute(0, 3, 1, 2).contiguous()
    return x, torch.from_numpy(y)
