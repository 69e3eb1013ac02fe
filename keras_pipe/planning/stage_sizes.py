"""Sizes of a model graph's calls and of a run of them as one stage.

`Profile` measures each call once (its outputs, what its gradient keeps,
its weights, what a split backward pass stashes of it) for micro-batches
of a given number of rows, and `Profile.block(a, b)` sums calls `a..b-1`
into a `Block` in O(1) with prefix sums: the planner's search compares
thousands of candidate stages. `features` lists a `Block`'s sizes in the
order the memory model's linear forms (`keras_pipe.planning.allocation`)
weigh them.
"""

import dataclasses
import math

import keras
import numpy as np

from keras_pipe.engine import microbatch as microbatch_lib
from keras_pipe.engine import products as products_lib
from keras_pipe.engine import schedule as schedule_lib
from keras_pipe.planning import backward as backward_lib
from keras_pipe.planning.balance import cost as cost_lib

__all__ = ["Block", "FEATURES", "Profile", "features", "second_largest",
           "transposes"]

# Activations whose gradient needs only the output (the tape keeps nothing
# more than the layer's output): other activations also keep their input.
_OUTPUT_ONLY = ("linear", "relu", "tanh", "sigmoid", "softmax", "relu6",
                "elu", "exponential")



# Inside the traced recompute-and-backward function a tensor stays alive
# only if a gradient op needs it: a call's output when its own gradient
# needs it (relu, tanh, ...) or a consumer's gradient needs its input
# (layers with weights, products, max pooling); sums, reshapes, average
# pooling need neither.
_NEEDS_NOTHING = (keras.layers.Add, keras.layers.Subtract,
                  keras.layers.Average, keras.layers.Concatenate,
                  keras.layers.Flatten, keras.layers.Reshape,
                  keras.layers.Identity, keras.layers.Dropout,
                  keras.layers.GlobalAveragePooling1D,
                  keras.layers.GlobalAveragePooling2D,
                  keras.layers.AveragePooling2D, keras.layers.ReLU,
                  keras.layers.Softmax, keras.layers.Activation)


def _gradient_needs(op):
    """(needs its input, needs its output) for the gradient of a layer."""
    activation = getattr(op, "activation", None)
    name = getattr(activation, "__name__", "linear")
    output_only = name in _OUTPUT_ONLY and name != "linear"
    if isinstance(op, (keras.layers.ReLU, keras.layers.Softmax)):
        return False, True
    if isinstance(op, _NEEDS_NOTHING) and not getattr(op, "weights", None):
        if isinstance(op, keras.layers.Activation) and not output_only:
            return True, False
        return False, output_only
    return True, output_only



def _attention_lengths(call, rows, shapes):
    """A `MultiHeadAttention` call's query and value lengths (tokens)."""
    query = cost_lib.dims(cost_lib.shape_of(call.inputs[0], shapes), rows)
    t_q = t_v = math.prod(query[1:-1])
    if len(call.inputs) > 1:
        t_v = math.prod(cost_lib.dims(
            cost_lib.shape_of(call.inputs[1], shapes), rows)[1:-1])
    return t_q, t_v



def _stashes_output_gradient(op):
    """Whether a split backward pass stashes the gradient of `op`'s
    output for its W: a layer with trainable weights, but not batch
    normalization, which in training scales by the batch's statistics:
    its weights meet only per-channel vectors (`x * (gamma *
    rsqrt(var))`), a stash of vectors."""
    return bool(getattr(op, "trainable_weights", None)) and not isinstance(
        op, keras.layers.BatchNormalization)


def _stash_bytes(call, rows, shapes=None):
    """What a split backward pass (`engine.weight_grad`) keeps of one call
    for its W: per mixing op (an op with a weight operand) its inputs and
    the gradient of its output, so for a call with trainable weights its
    distinct float inputs and its outputs; in attention also the
    projections' outputs (their gradients) and the attended values (the
    output projection's input). Nothing for calls without weights: the
    tape's other tensors (an activation's output, softmax scores) are
    freed when B returns."""
    op = call.operation
    if not _stashes_output_gradient(op):
        return 0
    if isinstance(op, (keras.layers.LayerNormalization,
                       keras.layers.GroupNormalization)):
        # `x * (rsqrt(var) * gamma)`: the product with gamma is per row,
        # the gradient of its output is stashed (its input is a vector).
        return sum(cost_lib.tensor_bytes(x, rows, shapes)
                   for x in call.outputs)
    seen, total = set(), 0
    for x in call.inputs:
        if id(x) in seen or "float" not in str(x.dtype):
            continue
        seen.add(id(x))
        total += cost_lib.tensor_bytes(x, rows, shapes)
    total += sum(cost_lib.tensor_bytes(x, rows, shapes)
                 for x in call.outputs)
    if isinstance(op, keras.layers.MultiHeadAttention):
        t_q, t_v = _attention_lengths(call, rows, shapes)
        value_dim = op.value_dim or op.key_dim
        total += 4 * rows * op.num_heads * (
            t_q * op.key_dim + t_v * op.key_dim + t_v * value_dim
            + t_q * value_dim)
    return total


def _transposed_bytes(call, rows, shapes=None):
    """Bytes of the transposed kernel a `Dense` call's forward product
    reads when the step transposes kernels (`engine.products`): its kernel
    if `products.eligible` and the product's rows (a micro-batch's, times
    the tokens Keras folds into them for a sequence) `products.fits`; the
    product is `MatMul(x, kernel)` only for a `Dense` (`EinsumDense`,
    attention and convolutions build other ops)."""
    op = call.operation
    if not isinstance(op, keras.layers.Dense) or op.kernel is None or \
            not products_lib.eligible(op.kernel):
        return 0
    dims = cost_lib.dims(cost_lib.shape_of(call.inputs[0], shapes), rows)
    if not products_lib.fits(math.prod(dims[:-1])):
        return 0
    return cost_lib.variable_bytes(op.kernel)


def transposes(mode, batch_size, num_micro_batches):
    """Whether a stage under remat `mode` gets transposed kernels in a step
    of `batch_size` rows (`products.transposes` of its micro-batches run in
    place: not rematerialized), as the executor decides."""
    sizes = microbatch_lib.split_sizes(batch_size, num_micro_batches)
    return products_lib.transposes(
        [n for i, n in enumerate(sizes)
         if not schedule_lib.is_remat(mode, i, len(sizes))])


@dataclasses.dataclass
class Block:
    """Sizes of a run of calls as one stage; activations per micro-batch."""

    weights: int        # bytes of every variable the calls use
    trainable: int      # bytes of the trainable ones
    inputs: int         # boundary input, one micro-batch
    outputs: int        # boundary output, one micro-batch
    activations: int    # what the tape keeps, one micro-batch
    recompute: int      # alive at once in a recompute, one micro-batch
    largest: int        # the largest single call output, one micro-batch
    largest_variable: int
    mixing: int         # outputs whose gradients a split backward stashes
    workspace: int = 0  # the largest scratch buffer of one backward op
    stash: int = 0      # a split backward's stash, one micro-batch
    seeded: int = 0     # of `mixing`: the last call's output (its gradient
    #                     is the stage's incoming one)
    transposed: int = 0  # kernels whose forward products read a transposed
    #                      copy (`products.eligible`), if the step makes them
    broadcast: int = 0  # broadcast kernels' gradients per row, one call's
    #                     `CONCURRENT_KERNELS` largest (`_broadcast_gradients`)
    after_broadcast: int = 0  # of `recompute`: the calls after the last
    #                           one with `broadcast`'s gradients
    second_variable: int = 0  # the second largest variable (of any call)
    forward_nodes: int = 0  # graph nodes of the calls' forward pass
    nodes: int = 0      # graph nodes of their forward and backward passes


class Profile:
    """Per-call sizes of a model graph for micro-batches of `rows` rows.

    `block(a, b)` gives the sizes of calls `a..b-1` as one stage in O(1)
    (prefix sums), which the planner's search needs.
    """

    def __init__(self, graph, rows, shapes=None):
        self.graph, self.rows = graph, rows
        n = len(graph.calls)
        needs_input = {}
        for call in graph.calls:
            wants = isinstance(call.operation, keras.layers.Layer) and \
                _gradient_needs(call.operation)[0]
            for x in call.inputs:
                needs_input[id(x)] = needs_input.get(id(x), False) or wants
        self.saved, self.recomputed, self.mixed = [0], [0], [0]
        self.stashed, self.transposed = [0], [0]
        self.forward_nodes, self.nodes = [0], [0]
        for call in graph.calls:
            forward_nodes, nodes = backward_lib.call_nodes(call, shapes)
            self.forward_nodes.append(self.forward_nodes[-1] + forward_nodes)
            self.nodes.append(self.nodes[-1] + nodes)
            self.transposed.append(self.transposed[-1] + _transposed_bytes(
                call, rows, shapes))
            self.stashed.append(self.stashed[-1] + _stash_bytes(
                call, rows, shapes))
            # What the tape keeps: the call's outputs and the inner
            # tensors its gradient reads.
            inner = backward_lib.kept_inside_bytes(call, rows, shapes)
            self.saved.append(self.saved[-1] + inner + sum(
                cost_lib.tensor_bytes(x, rows, shapes) for x in call.outputs))
            # The output gradients a split backward pass (`"Bi"`) makes
            # and stashes for W: not batch normalization's (a vector).
            self.mixed.append(self.mixed[-1] + (sum(
                cost_lib.tensor_bytes(x, rows, shapes) for x in call.outputs)
                if _stashes_output_gradient(call.operation) else 0))
            kept = inner
            op = call.operation
            own = isinstance(op, keras.layers.Layer) and _gradient_needs(
                op)[1]
            for x in call.outputs:
                if own or needs_input.get(id(x), False):
                    kept += cost_lib.tensor_bytes(x, rows, shapes)
            self.recomputed.append(self.recomputed[-1] + kept)
        self.out = [sum(cost_lib.tensor_bytes(x, rows, shapes) for x in c.outputs)
                     for c in graph.calls]
        self.workspace = [backward_lib.backward_workspace(c, shapes)
                          for c in graph.calls]
        self.broadcast = [rows * backward_lib.broadcast_bytes(c, shapes)
                          for c in graph.calls]
        self.freed = [rows * backward_lib.freed_before_broadcast(c, shapes)
                      for c in graph.calls]
        self.seeded = [o if _stashes_output_gradient(c.operation) else 0
                       for o, c in zip(self.out, graph.calls)]
        # A variable used by several calls (tied weights) is counted with
        # its last call: each stage's build places the variables of its
        # layers on its device, so the last stage to use one keeps it
        # (`engine.placement.place_variables`).
        own, largest_var, second_var = [(0, 0)] * n, [0] * n, [0] * n
        seen = {}   # variable -> the call it is counted with (its last)
        self._used = []   # per call: (variable, counted with, bytes, trainable)
        for c in reversed(range(n)):
            w = t = 0
            for v in getattr(graph.calls[c].operation, "weights", None) or []:
                size = cost_lib.variable_bytes(v)
                second_var[c] = max(second_var[c], min(size, largest_var[c]))
                largest_var[c] = max(largest_var[c], size)
                self._used.append((c, id(v), seen.get(id(v), c), size,
                                   v.trainable))
                if id(v) in seen:
                    continue
                seen[id(v)] = c
                w += size
                t += size if v.trainable else 0
            own[c] = (w, t)
        weights, trainable = [0], [0]
        for w, t in own:
            weights.append(weights[-1] + w)
            trainable.append(trainable[-1] + t)
        self.weights, self.trainable = weights, trainable
        self.largest_var, self.second_var = largest_var, second_var
        # Bytes alive across gap g (after call g), per micro-batch.
        made, needed = {}, {}
        for x in graph.inputs:
            made[id(x)] = -1
        for call in graph.calls:
            for x in call.inputs:
                needed[id(x)] = max(needed.get(id(x), -1), call.index)
            for x in call.outputs:
                made[id(x)] = call.index
        for x in graph.outputs:
            needed[id(x)] = n
        sizes = {}
        for x in list(graph.inputs) + [x for c in graph.calls
                                       for x in c.outputs]:
            sizes[id(x)] = cost_lib.tensor_bytes(x, rows, shapes)
        self.gap = [sum(sizes[k] for k in made
                         if made[k] <= g < needed.get(k, -2))
                     for g in range(n - 1)]
        self.input_bytes = sum(cost_lib.tensor_bytes(x, rows, shapes)
                               for x in graph.inputs)
        self.output_bytes = sum(cost_lib.tensor_bytes(x, rows, shapes)
                                for x in graph.outputs)

    def after_broadcast(self, a, b):
        """What the tape keeps of calls `a..b-1` after the last one with
        their largest broadcast kernel gradients (`broadcast_bytes`), and
        of that call after its first such product: freed by the backward
        pass before those gradients are made."""
        return self.after_broadcast_from(a, b)[-1]

    def after_broadcast_from(self, a, n):
        """`after_broadcast(a, b)` for every `b` in `a + 1 .. n`, in one
        pass over the calls (the planner's grid of blocks needs them all)."""
        result, most, last = [], 0, None
        for c in range(a, n):
            if self.broadcast[c] and self.broadcast[c] >= most:
                most, last = self.broadcast[c], c
            result.append(0 if last is None else self.recomputed[c + 1]
                          - self.recomputed[last + 1] + self.freed[last])
        return result

    def block(self, a, b, alone=False):
        """Sizes of calls `a..b-1` as one stage.

        A variable several calls use (tied weights) counts with its last
        call, on the stage that keeps it in a pipeline; `alone=True`: as
        the stage built and run alone (`tools/memory_model.py`), which
        holds every variable its calls use, with its sums and slots.
        """
        n = len(self.graph.calls)
        weights = self.weights[b] - self.weights[a]
        trainable = self.trainable[b] - self.trainable[a]
        if alone:
            later = {v: (size, t) for c, v, owner, size, t in self._used
                     if a <= c < b and owner >= b}
            weights += sum(size for size, _ in later.values())
            trainable += sum(size for size, t in later.values() if t)
        return Block(
            weights=weights,
            trainable=trainable,
            inputs=self.input_bytes if a == 0 else self.gap[a - 1],
            outputs=self.output_bytes if b == n else self.gap[b - 1],
            activations=self.saved[b] - self.saved[a],
            recompute=self.recomputed[b] - self.recomputed[a],
            largest=max(self.out[a:b]),
            largest_variable=max(self.largest_var[a:b]),
            second_variable=int(second_largest(self.largest_var[a:b],
                                               self.second_var[a:b])[-1]),
            mixing=self.mixed[b] - self.mixed[a],
            workspace=max(self.workspace[a:b]),
            broadcast=max(self.broadcast[a:b]),
            after_broadcast=self.after_broadcast(a, b),
            stash=self.stashed[b] - self.stashed[a],
            transposed=self.transposed[b] - self.transposed[a],
            forward_nodes=self.forward_nodes[b] - self.forward_nodes[a],
            nodes=self.nodes[b] - self.nodes[a],
            seeded=self.seeded[b - 1])




FEATURES = ("inputs", "outputs", "activations", "recompute", "trainable",
            "largest", "largest_variable", "mixing", "workspace", "stash",
            "seeded", "transposed", "broadcast", "after_broadcast",
            "second_variable")


def features(block):
    """A `Block`'s sizes in the order of `FEATURES`."""
    return np.array([getattr(block, name) for name in FEATURES], float)



def second_largest(largest, second):
    """Per prefix of a run of calls, the second largest of their variables,
    from each call's largest and second largest (lists or 1-D arrays):
    after a call, the old largest or the call's own largest (whichever is
    smaller) or its second may be the new second."""
    largest = np.asarray(largest, float)
    before = np.concatenate([[0.0], np.maximum.accumulate(largest)[:-1]])
    return np.maximum.accumulate(np.maximum(
        np.asarray(second, float), np.minimum(largest, before)))

