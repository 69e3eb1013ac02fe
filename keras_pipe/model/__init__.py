"""The Keras glue: `PipelineModel` and its groups of methods.

`pipeline` holds the model (validation, the stages, compile and the step
methods); `building` builds it before the first trace, `calls` routes
`fit`, `evaluate` and `predict`, `first_batch` makes the choices left to
the pipeline when it first sees a batch, `inference` runs `predict` and
`evaluate` as streams of micro-batches, `generation` runs a KerasHub
causal LM's `generate` through the stages, and `replication` runs
data-parallel copies of the pipeline.
"""

from keras_pipe.model.pipeline import PipelineModel

__all__ = ["PipelineModel"]
