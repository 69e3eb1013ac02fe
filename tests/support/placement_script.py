"""Trains one step of a 2-stage pipeline and prints where TF placed each op.

Run as a subprocess by test_placement.py: the placer log
(`tf.debugging.set_log_device_placement`) is written by TF's C++ code to
stderr, one `name: (OpType): device` line per op.
"""

import json
import os
import sys

os.environ["TF_CPP_MIN_LOG_LEVEL"] = "0"

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import keras_pipe  # noqa: E402

remat = sys.argv[1]
if len(sys.argv) > 2:  # a dtype policy, e.g. "mixed_float16"
    keras.mixed_precision.set_global_policy(sys.argv[2])
devices = keras_pipe.logical_cpu_devices(2)
# Must be set before TF initializes to reach the placer of tf.functions.
tf.debugging.set_log_device_placement(True)
# Layer names start with "s{j}_": the ops inside stage j's traced function
# are named after its layers, so the test can tell the stages apart.
stages = [
    keras.Sequential([keras.layers.Dense(8, name="s0_dense"),
                      keras.layers.BatchNormalization(name="s0_norm"),
                      keras.layers.Dropout(0.5, name="s0_dropout")],
                     name="s0_stage"),
    keras.Sequential([keras.layers.Dense(8, activation="relu",
                                         name="s1_dense"),
                      keras.layers.Dense(2, name="s1_logits",
                                         dtype="float32")],
                     name="s1_stage"),
]
model = keras_pipe.PipelineModel(stages, devices=devices,
                                 num_micro_batches=2, remat=remat,
                                 schedule="gpipe")
model.build((None, 4))
model.compile(keras.optimizers.Adam(), "mse")
model.train_on_batch(np.ones((6, 4), "float32"), np.ones((6, 2), "float32"))
variables = {v.path: v.value.device for v in model.variables}
slots = {v.path: v.value.device for v in model.optimizer.variables}
gradients = [sum(1 for _ in s.trainable_variables) for s in stages]
print("RESULT " + json.dumps({"variables": variables, "slots": slots,
                              "gradients_per_stage": gradients,
                              "stage_devices": [
                                  [v.path for v in s.variables]
                                  for s in stages]}), flush=True)
