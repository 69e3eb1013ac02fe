"""Balancing pipeline stages: cost models and the optimal block partition."""

from keras_pipe.planning.balance import cost
from keras_pipe.planning.balance.blockpartition import block_partition

__all__ = ["block_partition", "cost"]
