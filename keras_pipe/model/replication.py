"""`PipelineModel.replicate`: data-parallel copies of the pipeline.

The Keras side only: the runners of each replica and the sum of their
gradients on each variable's device are `keras_pipe.engine.replicas`.
"""

from keras_pipe.engine import replicas as replicas_lib

__all__ = ["Replication"]


class Replication:
    """`PipelineModel`'s data-parallel replicas (a mixin before
    `keras.Model`)."""

    @property
    def num_replicas(self):
        """`R`, the copies of the pipeline that `replicate` set (1 if none)."""
        return self._executor.num_replicas

    def replicate(self, devices):
        """Runs R copies of the pipeline on `R * K` devices, data parallel.

        Replica `r` runs stage `j` on `devices[r * K + j]` on its shard of
        each global batch (`M` micro-batches of `R * M`); gradients are
        summed over replicas on each variable's device before the one
        optimizer step (see `keras_pipe.engine.replicas`). The first `K` devices
        must be the model's own. `replicate(model.devices)` undoes it.

        ```python
        model = keras_pipe.PipelineModel(stages, devices=devices[:2],
                                         num_micro_batches=4)
        model.replicate(devices[:4])    # 2 replicas x 2 stages
        ```

        Raises:
            TypeError, ValueError: see `keras_pipe.engine.replicas.make_runners`.
        """
        self._executor.replicas = replicas_lib.make_runners(
            self._runners, devices)
        self.train_function = self.test_function = None
        self.predict_function = None
