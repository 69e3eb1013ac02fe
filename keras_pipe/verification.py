"""A check users run on their own model: the pipeline's steps against Keras'.

keras_pipe promises that a pipelined step is the unsplit model's step. Its
tests prove that on their models; `verify` proves it on the user's, on the
user's batch: the same weights, a few optimizer steps of plain Keras on the
unsplit model and of the pipeline, every variable compared, and the known
reasons for a difference named (BatchNormalization at M > 1, mixed
precision) so that anything else stands out.
"""

import dataclasses

import keras
import numpy as np
import tensorflow as tf

from keras_pipe import _compat
from keras_pipe.engine import placement
from keras_pipe.model import PipelineModel
from keras_pipe.reporting import ADDED_LOSSES

__all__ = ["ADDED_LOSSES", "VariableDifference", "VerificationReport",
           "verify"]

# Layers whose randomness is set aside (attribute set to 0 for the check).
_RANDOM = ((keras.layers.Dropout, "rate"),
           (keras.layers.GaussianDropout, "rate"),
           (keras.layers.AlphaDropout, "rate"),
           (keras.layers.GaussianNoise, "stddev"))
# Stochastic depth (KerasHub's DropPath, keras.applications' StochasticDepth)
# has no common base class: known by its class name, set aside by its rate.
_STOCHASTIC_DEPTH = ("DropPath", "StochasticDepth")
_STOCHASTIC_DEPTH_RATES = ("drop_prob", "drop_path_rate", "rate")

BATCH_NORM = ("BatchNormalization at M > 1: training normalizes each "
              "micro-batch with its own statistics (DeferredBatchNormalization"
              " too: it makes only the moving statistics the unsplit ones); "
              "num_micro_batches=1 is exact")
NOISE = ("gradient at float-rounding level (a key bias under softmax, a "
         "parameter the loss does not depend on): Adam, RMSprop and the like "
         "normalize the noise into full steps of either sign; or a statistic "
         "that moved and differs at rounding level (at most 1e-5 of the largest "
         "update)")
ROUNDING = ("rounding amplified: the pipeline's gradients at the start equal "
            "plain Keras' to float precision (at most 1e-4 of the variable's "
            "largest gradient), yet the weights after the steps differ: "
            "Adam, RMSprop and the like turn the rounding of near-zero "
            "gradient elements into full steps, an update of a few units in "
            "the last place of a weight shows its rounding, and an unstable "
            "trajectory grows it step by step")
# Largest |g_pipeline - g_keras| / max|g_keras| of a variable at the start
# that counts as float rounding (float32 sums in another order: ~1e-6).
GRADIENT_TOLERANCE = 1e-4
MIXED_PRECISION = ("mixed precision: float16/bfloat16 computations rounded "
                   "in another order")


@dataclasses.dataclass
class VariableDifference:
    """One variable after the steps: pipeline against plain Keras."""

    path: str
    shape: tuple
    update: float      # max |w_keras - w_start|
    difference: float  # max |w_pipeline - w_keras|
    gradient: float = None  # max |dloss/dw| at the start; None: untrained
    # max |g_pipeline - g_keras| at the start; None: untrained or unknown
    gradient_difference: float = None

    @property
    def relative(self):
        """`difference / update` (the difference itself if nothing moved)."""
        return self.difference / self.update if self.update else \
            self.difference

    @property
    def gradient_relative(self):
        """`gradient_difference / gradient`, or None if either is unknown."""
        if self.gradient_difference is None or self.gradient is None:
            return None
        return (self.gradient_difference / self.gradient if self.gradient
                else self.gradient_difference)


@dataclasses.dataclass
class VerificationReport:
    """What `keras_pipe.verify` found; `str(report)` is a readable table.

    Attributes:
        ok: True when every variable and the predictions are within
            tolerance, or differ only for a named known cause.
        num_stages, num_micro_batches, schedule, steps: what was run.
        losses_keras, losses_pipeline: the loss of each step.
        prediction_difference: max |y_pipeline - y_keras| / max |y_keras|
            of `predict` at the starting weights.
        variables: a `VariableDifference` per float variable, largest
            relative difference first.
        causes: the known causes seen (BatchNormalization at M > 1, mixed
            precision): differences they explain are not flagged.
        flagged: paths of the variables off by more than `tolerance` of
            their update with no known cause.
        set_aside: the random layers (Dropout, ..., stochastic depth such
            as KerasHub's DropPath) switched off.
        tolerance: the largest difference relative to the update accepted.
        noise: paths of the variables whose gradient is at rounding level
            (at most 1e-5 of the largest), or, for variables without a
            gradient (moving statistics), whose update and difference are
            (at most 1e-5 of the largest update), and the trainable
            variables beyond tolerance whose gradient at the start equals
            plain Keras' to `GRADIENT_TOLERANCE` of its largest while every
            statistic is within tolerance (rounding the steps amplified):
            their difference is named, not flagged, and left out of
            `largest`.
    """

    ok: bool
    num_stages: int
    num_micro_batches: int
    schedule: str
    steps: int
    losses_keras: list
    losses_pipeline: list
    prediction_difference: float
    variables: list
    causes: list
    flagged: list
    set_aside: list
    tolerance: float
    noise: list = dataclasses.field(default_factory=list)

    @property
    def largest(self):
        """The largest relative difference of a variable (noise left out)."""
        return max((v.relative for v in self.variables
                    if v.path not in self.noise), default=0.0)

    def __str__(self):
        verdict = "OK" if self.ok else (
            "DIFFERENT (unexplained)" if self.flagged else
            "DIFFERENT (explained by the causes below)")
        losses = ", ".join(f"{a:.6g} / {b:.6g}" for a, b in zip(
            self.losses_keras, self.losses_pipeline))
        lines = [
            f"keras_pipe.verify: {verdict}",
            (f"  {self.num_stages} stages, M={self.num_micro_batches}, "
             f"schedule={self.schedule!r}, {self.steps} step(s); tolerance "
             f"{self.tolerance:g} of each variable's update"),
            f"  loss (keras / pipeline): {losses}",
            (f"  predictions: max difference "
             f"{self.prediction_difference:.3g} of their scale"),
            (f"  variables: {len(self.variables)}, largest difference "
             f"{self.largest:.3g} of the update"),
        ]
        if self.set_aside:
            lines.append("  set aside: " + ", ".join(self.set_aside))
        for cause in self.causes:
            lines.append(f"  known cause: {cause}")
        if self.flagged:
            lines.append(f"  flagged ({len(self.flagged)}): "
                         + ", ".join(self.flagged[:8])
                         + (" ..." if len(self.flagged) > 8 else ""))
        width = max([len(v.path) for v in self.variables[:10]] + [8])
        # gradient: max |g_pipeline - g_keras| / max |g_keras| at the start.
        lines.append(f"  {'variable':<{width}}  {'update':>10}  "
                     f"{'difference':>10}  {'relative':>10}  "
                     f"{'gradient':>10}")
        for v in self.variables[:10]:
            g = v.gradient_relative
            lines.append(f"  {v.path:<{width}}  {v.update:10.3g}  "
                         f"{v.difference:10.3g}  {v.relative:10.3g}  "
                         + (f"{g:10.3g}" if g is not None else f"{'-':>10}"))
        if len(self.variables) > 10:
            lines.append(f"  ... {len(self.variables) - 10} more, each "
                         f"within {self.variables[10].relative:.3g}")
        return "\n".join(lines)


class _Unsplit(keras.Model):
    """The user's model behind a fresh `keras.Model`: its own compile."""

    def __init__(self, model):
        super().__init__(name=f"unsplit_{model.name}")
        self.inner = model

    def call(self, inputs, training=False):
        return self.inner(inputs, training=training)


def verify(model, x, y, loss=None, optimizer=None, num_stages=None,
           num_micro_batches=None, schedule=None, devices=None, steps=2,
           sample_weight=None, tolerance=1e-3, **pipeline_kwargs):
    """Checks that the pipeline trains `model` as plain Keras does.

    From the same weights, runs `steps` optimizer steps of plain Keras on the
    unsplit model (a copy of it with every variable on the first stage's
    device, where Keras can clone it: some layers, a grouped `Conv2D`, run
    as XLA functions that read no variable on another device) and of the
    pipeline on the batch `(x, y)`, compares
    `predict` at the start and every float variable at the end, and puts the
    weights back. Dropout, other random layers and stochastic depth
    (DropPath) are set aside (rate 0)
    for the check: the pipeline draws its masks per row, not as Keras does.
    A difference is reported relative to the variable's update
    (`max|w_pipeline - w_keras| / max|w_keras - w_start|`), so a float
    rounding shows as ~1e-6 and a different step as ~1. Known causes that
    make the pipeline train differently on purpose are named:
    BatchNormalization at M > 1 (per-micro-batch statistics), a loss a
    layer adds (`add_loss`) at M > 1 (the micro-batches' values averaged:
    not the unsplit value unless a mean over samples) and mixed precision
    (rounding); a difference with no known cause is flagged.

    ```python
    report = keras_pipe.verify(model, x, y, loss="mse", optimizer="adam",
                               num_stages=2, num_micro_batches=4)
    print(report)
    assert report.ok
    ```

    Args:
        model: a built `keras.Model` (cut with
            `PipelineModel.from_model`) or a `PipelineModel` (its stages,
            devices, `num_micro_batches`, `remat` and `schedule` are used;
            `num_stages`, `num_micro_batches`, `schedule`, `devices` and
            `pipeline_kwargs` must then be left out).
        x, y: one batch, as `fit` takes it (arrays, dicts of arrays).
        loss: a Keras loss. Defaults to `None`: the loss `model` was
            compiled with.
        optimizer: a Keras optimizer (name, config or instance: fresh copies
            are made, the instance is not stepped). Defaults to `None`: the
            one `model` was compiled with.
        num_stages: stages to cut `model` into. Defaults to `None`: 2.
        num_micro_batches: `M`. Defaults to `None`: 2.
        schedule: a registered schedule. Defaults to `None`: `"gpipe"`.
        devices: one device per stage. Defaults to `None` (as
            `PipelineModel`).
        steps: optimizer steps to compare. Defaults to `2`.
        sample_weight: per-sample weights of the batch. Defaults to `None`.
        tolerance: the largest difference, relative to each variable's
            update, that counts as equal. Defaults to `1e-3`.
        **pipeline_kwargs: more `PipelineModel.from_model` arguments
            (`balance`, `remat`, `input_shape`).

    Returns:
        A `VerificationReport`; `print` it, test `report.ok`.

    Raises:
        TypeError: if `model` is not a Keras model.
        ValueError: if no loss or optimizer is given nor compiled, `steps`
            is not a positive integer, or pipeline arguments are given with
            a `PipelineModel`.
    """
    if not isinstance(model, keras.Model):
        raise TypeError("verify() takes a keras.Model or a "
                        f"keras_pipe.PipelineModel. Received: {model!r}")
    if not isinstance(steps, int) or isinstance(steps, bool) or steps < 1:
        raise ValueError(f"steps must be a positive integer. Received: "
                         f"steps={steps!r}")
    loss = loss if loss is not None else getattr(model, "loss", None)
    if loss is None:
        raise ValueError("verify() needs a loss: pass loss=... (or compile "
                         "the model first). Received: loss=None")
    optimizer = optimizer if optimizer is not None else getattr(
        model, "optimizer", None)
    if optimizer is None:
        raise ValueError("verify() needs an optimizer: pass optimizer=... "
                         "(or compile the model first). Received: "
                         "optimizer=None")
    if isinstance(model, PipelineModel):
        given = dict(pipeline_kwargs, devices=devices, num_stages=num_stages,
                     num_micro_batches=num_micro_batches, schedule=schedule)
        given = {k: v for k, v in given.items() if v is not None}
        if given:
            raise ValueError(
                "verify() runs a PipelineModel as it is: leave out "
                f"{sorted(given)} (they apply to a keras.Model it cuts).")
        pipe = PipelineModel(
            model.stages, devices=list(model.devices),
            num_micro_batches=model.num_micro_batches, remat=model.remat,
            schedule=model.schedule)
        unsplit = model.to_model()
    else:
        pipe = PipelineModel.from_model(
            model, 2 if num_stages is None else num_stages, devices=devices,
            num_micro_batches=(2 if num_micro_batches is None
                               else num_micro_batches),
            schedule=schedule or "gpipe", **pipeline_kwargs)
        unsplit = model
    floats = [i for i, v in enumerate(unsplit.weights) if _is_float(v)]
    variables = [unsplit.weights[i] for i in floats]
    start = [v.numpy() for v in unsplit.weights]
    set_aside = _set_aside_randomness(pipe.layers)
    try:
        # Plain Keras runs on a copy whose variables are all on the first
        # stage's device: the pipeline's are spread over its devices, and
        # Keras runs some layers (a grouped Conv2D) as XLA functions,
        # which read no variable on another device.
        copy = _copy_on(unsplit, pipe.devices[0], start)
        reference = _Unsplit(copy)
        expected_pred = _predict(reference, x)
        actual_pred = _predict(pipe, x)
        losses_keras = _train(reference, loss, optimizer, x, y,
                              sample_weight, steps)
        copied = [copy.weights[i] for i in floats]
        expected = [v.numpy() for v in copied]
        _assign(copy.weights, start)
        grads = _gradients(reference, copied, x, y, sample_weight)
        _assign(copy.weights, start)  # the pass moved BN statistics
        losses_pipe = _train(pipe, loss, optimizer, x, y, sample_weight,
                             steps)
        actual = [v.numpy() for v in variables]
        _assign(unsplit.weights, start)
        pipe_grads = _pipeline_gradients(pipe, variables, x, y,
                                         sample_weight)
    finally:
        _assign(unsplit.weights, start)
        for layer, attribute, value in set_aside:
            setattr(layer, attribute, value)
    rows = []
    for i, v, e, a, c in zip(floats, variables, expected, actual, copied):
        s = start[i]
        rows.append(VariableDifference(
            v.path, tuple(v.shape),
            float(np.max(np.abs(e.astype("float64") - s), initial=0.0)),
            float(np.max(np.abs(a.astype("float64") - e), initial=0.0)),
            _largest(grads[id(c)]),
            _largest_difference(pipe_grads.get(id(v)), grads[id(c)])))
    rows.sort(key=lambda r: r.relative, reverse=True)
    scale = max(float(np.max(np.abs(e), initial=0.0))
                for e in keras.tree.flatten(expected_pred)) or 1.0
    prediction = max(float(np.max(np.abs(a - e), initial=0.0))
                     for e, a in zip(keras.tree.flatten(expected_pred),
                                     keras.tree.flatten(actual_pred))) / scale
    causes = _known_causes(pipe)
    off = [r for r in rows if r.relative > tolerance]
    largest_gradient = max((r.gradient for r in rows
                            if r.gradient is not None), default=0.0)
    largest_update = max((r.update for r in rows), default=0.0)
    # A trained variable whose gradient is rounding, or a statistic (no
    # gradient) that moved, and differs, at rounding level of the largest
    # update (not one that only the pipeline moved): a moving mean after
    # a layer whose input is already centered records rounding and the
    # noise steps of the layers before.
    noise = [r.path for r in off if (
        r.gradient <= 1e-5 * largest_gradient if r.gradient is not None
        else max(r.update, r.difference) <= 1e-5 * largest_update)]
    if noise:
        causes.append(f"{NOISE}: {', '.join(noise[:4])}"
                      + (" ..." if len(noise) > 4 else ""))
    off = [r for r in off if r.path not in noise]
    # Trainable variables off whose gradients at the start are equal to
    # float precision: rounding the steps amplified, named, not flagged
    # (only while every statistic, which has no gradient to compare, is
    # within tolerance or noise).
    if not any(r.gradient is None for r in off):
        rounding = [r.path for r in off if r.gradient_relative is not None
                    and r.gradient_relative <= GRADIENT_TOLERANCE]
        if rounding:
            causes.append(f"{ROUNDING}: {', '.join(rounding[:4])}"
                          + (" ..." if len(rounding) > 4 else ""))
            noise += rounding
    off = [r.path for r in off if r.path not in noise]
    explained = any(c in (BATCH_NORM, MIXED_PRECISION, ADDED_LOSSES)
                    for c in causes)
    flagged = [] if explained else list(off)
    if prediction > tolerance and not explained:
        flagged.append("(predictions)")
    return VerificationReport(
        ok=not off and prediction <= tolerance,
        num_stages=pipe.num_stages, num_micro_batches=pipe.num_micro_batches,
        schedule=pipe.schedule, steps=steps, losses_keras=losses_keras,
        losses_pipeline=losses_pipe, prediction_difference=prediction,
        variables=rows, causes=causes, flagged=flagged,
        set_aside=[f"{layer.name}.{attribute}={value}"
                   for layer, attribute, value in set_aside],
        tolerance=tolerance, noise=noise)


def _is_float(variable):
    return "float" in keras.backend.standardize_dtype(variable.dtype)


def _assign(variables, values):
    for v, value in zip(variables, values):
        v.assign(value)


def _copy_on(model, device, values):
    """A clone of `model` with its own variables, all on `device`, set to
    `values` (one per `model.weights`); `model` itself when Keras cannot
    clone it (a subclassed layer without a working `get_config`) into the
    same variables, with the values assigned all the same."""
    try:
        with tf.device(device):
            copy = keras.models.clone_model(model)
    except Exception:  # noqa: BLE001 (any failure: run on the model itself)
        copy = None
    # The same layers built in the same order: the same variables, in
    # order (auto-named inner layers take other names: not compared).
    if copy is None or [tuple(v.shape) for v in copy.weights] != [
            tuple(v.shape) for v in model.weights]:
        copy = model
    else:
        placement.place_variables(copy, device)
        # A layer rebuilt from its config makes its own Dropout anew, at
        # the rate it was given: set aside there too (the copy is dropped).
        _set_aside_randomness([copy])
    _assign(copy.weights, values)
    return copy


def _fresh(optimizer):
    """A new optimizer with `optimizer`'s configuration."""
    if isinstance(optimizer, keras.optimizers.Optimizer):
        return optimizer.__class__.from_config(optimizer.get_config())
    return keras.optimizers.get(optimizer)


def _predict(model, x):
    batch = len(keras.tree.flatten(x)[0])
    return model.predict(x, batch_size=batch, verbose=0)


def _gradients(model, variables, x, y, sample_weight):
    """`{id(variable): gradient array or None}` of one plain Keras loss."""
    x, y = keras.tree.map_structure(tf.convert_to_tensor, (x, y))
    with tf.GradientTape() as tape:
        y_pred = model(x, training=True)
        loss = model.compute_loss(x, y, y_pred, sample_weight, training=True)
    trainable = {id(v) for v in model.trainable_variables}
    grads = tape.gradient(loss, variables)
    grads = [g if id(v) in trainable else None
             for v, g in zip(variables, grads)]
    return {id(v): None if g is None else tf.convert_to_tensor(g).numpy()
            for v, g in zip(variables, grads)}


def _pipeline_gradients(pipe, variables, x, y, sample_weight):
    """`{id(variable): gradient array}` of one pipelined loss, for those of
    `variables` the pipeline trains (the step's graph, as `fit` runs it)."""
    x, y = keras.tree.map_structure(tf.convert_to_tensor, (x, y))
    if sample_weight is not None:
        sample_weight = tf.convert_to_tensor(sample_weight)
    wanted = {id(v) for v in variables}
    trainable = pipe.trainable_variables
    _, _, grads = tf.function(lambda: pipe.compute_loss_and_gradients(
        x, y, sample_weight), autograph=False)()
    return {id(v): tf.convert_to_tensor(g).numpy()
            for v, g in zip(trainable, grads)
            if id(v) in wanted and g is not None}


def _largest(array):
    """max |array|, or None for no array."""
    return None if array is None else float(np.max(np.abs(array),
                                                   initial=0.0))


def _largest_difference(a, b):
    """max |a - b|, or None if either is missing."""
    if a is None or b is None:
        return None
    return float(np.max(np.abs(a.astype("float64") - b), initial=0.0))


def _train(model, loss, optimizer, x, y, sample_weight, steps):
    model.compile(_fresh(optimizer), loss=loss, jit_compile=False)
    # Slots made before the first step: made inside it, they make TF trace
    # Keras' train function twice (PipelineModel.compile does the same).
    if not model.optimizer.built:
        model.optimizer.build(model.trainable_variables)
    return [float(np.ravel(model.train_on_batch(
        x, y, sample_weight=sample_weight))[0]) for _ in range(steps)]


def _set_aside_randomness(layers):
    """Sets Dropout-like and stochastic depth layers' rate to 0; returns
    what to put back."""
    found = []
    for top in layers:
        for layer in _compat.flatten_layers(top):
            for kind, attribute in _RANDOM + _stochastic_depth(layer):
                value = getattr(layer, attribute, 0)
                if isinstance(layer, kind) and value:
                    found.append((layer, attribute, value))
                    setattr(layer, attribute, 0.0)
                    break
    return found


def _stochastic_depth(layer):
    """`((class, rate attribute),)` if `layer` is a stochastic depth layer."""
    if not any(name in type(layer).__name__ for name in _STOCHASTIC_DEPTH):
        return ()
    return tuple((type(layer), attribute) for attribute in
                 _STOCHASTIC_DEPTH_RATES
                 if isinstance(getattr(layer, attribute, None), float))


def _known_causes(pipe):
    """The known reasons for a pipelined step to differ, as sentences."""
    causes = []
    layers = [sub for top in pipe.layers for sub in _compat.flatten_layers(top)]
    if pipe.num_micro_batches > 1 and any(
            isinstance(layer, keras.layers.BatchNormalization)
            for layer in layers):
        causes.append(BATCH_NORM)
    if any(layer.dtype_policy.compute_dtype in ("float16", "bfloat16")
           for layer in layers):
        causes.append(MIXED_PRECISION)
    if pipe.num_micro_batches > 1 and pipe.loss_adding_stages:
        causes.append(ADDED_LOSSES)
    return causes
