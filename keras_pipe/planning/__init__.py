"""Planning: the graph of a model, cuts, balance, memory and time models.

Reads a Keras model (`graph`), cuts it into stages (`partition`, `balance`),
predicts memory (`memory`) and chooses the cut, micro-batches and remat for
a budget (`budget`, `planner`). May import `keras_pipe.engine`, and of
`keras_pipe.distributed` only the worker heap's settings
(`distributed.heap`); nothing from `keras_pipe.saving`.
Internal: users call `keras_pipe.plan` and `PipelineModel.from_model`.
"""
