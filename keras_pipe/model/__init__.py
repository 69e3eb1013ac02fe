"""The Keras glue: `PipelineModel` and its groups of methods.

`pipeline` holds the model (validation, the stages, compile and the step
methods); `building` builds it before the first trace, `calls` routes
`fit`, `evaluate` and `predict`, and `first_batch` makes the choices left
to the pipeline when it first sees a batch.
"""

from keras_pipe.model.pipeline import PipelineModel

__all__ = ["PipelineModel"]
