"""Model-zoo equivalence sweep: keras_pipe.verify on KerasHub tiny configs
and keras.applications, cut into 2-3 stages.

Each case: predictions at the start and 3 Adam steps against plain Keras
on one device, within verify's tolerance (1e-3 of each variable's update;
measured values are ~1e-6, see docs/exactness.md). BatchNormalization at
M > 1 is the one stated exception: verify names it and flags nothing else.
Built from config (no download), dropout set aside by verify.

    python -m tests.test_zoo [MODEL ...]   prints the table of
                                           docs/exactness.md
"""

import keras
import numpy as np
import pytest

pytestmark = pytest.mark.slow

keras_hub = pytest.importorskip("keras_hub")

CE = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
SEQ, VOCAB = 8, 40


def _vit():
    backbone = keras_hub.models.ViTBackbone(
        image_shape=(16, 16, 3), patch_size=8, num_layers=2, num_heads=2,
        hidden_dim=8, mlp_dim=16)
    model = keras_hub.models.ViTImageClassifier(
        backbone=backbone, num_classes=3, preprocessor=None)
    x = np.random.default_rng(0).normal(size=(8, 16, 16, 3)).astype("float32")
    return model, x, {}


def _bert():
    backbone = keras_hub.models.BertBackbone(
        vocabulary_size=VOCAB, num_layers=2, num_heads=2, hidden_dim=8,
        intermediate_dim=16, max_sequence_length=SEQ)
    model = keras_hub.models.BertTextClassifier(
        backbone=backbone, num_classes=3, preprocessor=None)
    rng = np.random.default_rng(0)
    x = {"token_ids": rng.integers(1, VOCAB, (8, SEQ)).astype("int32"),
         "padding_mask": np.ones((8, SEQ), "int32"),
         "segment_ids": np.zeros((8, SEQ), "int32")}
    return model, x, {"input_shape": {k: (None, SEQ) for k in x}}


def _mobilenet():
    model = keras.applications.MobileNetV3Small(
        input_shape=(32, 32, 3), weights=None, classes=3,
        include_preprocessing=False, classifier_activation=None,
        minimalistic=True, alpha=0.75)
    x = np.random.default_rng(0).normal(size=(8, 32, 32, 3)).astype("float32")
    return model, x, {}


# (name, builder, stages, M, schedule, BatchNormalization expected)
CASES = [
    ("ViTImageClassifier", _vit, 3, 1, "gpipe", False),
    ("ViTImageClassifier", _vit, 3, 4, "1f1b", False),
    ("BertTextClassifier", _bert, 2, 2, "zb_h2", False),
    ("MobileNetV3Small", _mobilenet, 2, 1, "gpipe", False),
    ("MobileNetV3Small", _mobilenet, 2, 2, "1f1b", True),
]


BATCH_NORM = ("BatchNormalization at M > 1: training normalizes each "
              "micro-batch")


def run_case(case, devices):
    """`keras_pipe.verify` on one case; returns its report."""
    import keras_pipe  # after the devices are made, in __main__
    _, build, num_stages, m, schedule, _ = case
    keras.utils.set_random_seed(0)
    model, x, kwargs = build()
    y = (np.arange(8) % 3).astype("int32")
    return keras_pipe.verify(
        model, x, y, loss=CE, optimizer=keras.optimizers.Adam(1e-2),
        num_stages=num_stages, num_micro_batches=m, schedule=schedule,
        devices=devices[:num_stages], steps=3, **kwargs)


@pytest.mark.parametrize("case", CASES, ids=[
    f"{c[0]}-K{c[2]}-M{c[3]}-{c[4]}" for c in CASES])
def test_zoo_model_trains_as_keras(devices, case):
    report = run_case(case, devices)
    batch_norm = case[5]
    assert not report.flagged, report
    assert report.prediction_difference < 1e-4, report
    # Rounding-level gradients (attention key biases) may be named too.
    if batch_norm:
        assert report.causes[0].startswith(BATCH_NORM) and not report.ok, (
            report)
    else:
        assert report.ok and not any(c.startswith(BATCH_NORM)
                                     for c in report.causes), report


if __name__ == "__main__":
    import keras_pipe
    devices = keras_pipe.logical_cpu_devices(4)
    print("| model | stages | M | schedule | prediction diff | step diff "
          "| loss step 3 (keras / pipeline) | verdict |")
    print("|---|---|---|---|---|---|---|---|")
    import sys
    for case in CASES:
        if len(sys.argv) > 1 and case[0] not in sys.argv[1:]:
            continue
        r = run_case(case, devices)
        verdict = "equal" if r.ok else (
            "BatchNormalization at M>1 (named)" if r.causes else "FLAGGED")
        print(f"| {case[0]} | {case[2]} | {case[3]} | {case[4]} | "
              f"{r.prediction_difference:.1e} | {r.largest:.1e} | "
              f"{r.losses_keras[-1]:.5f} / {r.losses_pipeline[-1]:.5f} | "
              f"{verdict} |", flush=True)
        if not r.ok:
            print(r, flush=True)
