"""Saving: `.keras` files, weights files and SavedModel export.

Atomic saves and checked loads (`files`), the unpipelined model and
serving exports (`export`). May import `keras_pipe.engine` and
`keras_pipe.planning` (a cut model is rebuilt from its partition).
Internal: users call `PipelineModel.save` / `export` and
`keras_pipe.load_model`.
"""
