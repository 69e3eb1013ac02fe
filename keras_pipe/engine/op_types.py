"""Graph op types, by what an op does with its inputs' buffers.

The engine orders each variable update after the reads that share its
buffer (`in_place`) and finds which tensors depend on the batch
(`gradients`); the memory model finds which tensors a gradient keeps
alive (`keras_pipe.planning.backward`). All three classify TF ops the
same way, from these sets.
"""

__all__ = ["SHAPE_ONLY", "VIEWS"]

# Ops whose output shares its input's buffer (TF forwards it): a tensor
# passed through one still holds the buffer. Output `k` of a multi-output
# view (`IdentityN`) is its input `k`.
VIEWS = frozenset(["Identity", "IdentityN", "StopGradient", "Reshape",
                   "Squeeze", "ExpandDims", "Snapshot"])

# Ops that read only their inputs' shapes: their output depends on no
# value, and they do not keep their input alive (they run as soon as it
# is made).
SHAPE_ONLY = frozenset(["Shape", "ShapeN", "Size", "Rank", "VariableShape",
                        "TensorListLength", "TensorArraySizeV3"])
