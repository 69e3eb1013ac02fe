"""What a stage holds at each moment of a step, as linear forms of its sizes.

The allocation rules of the memory model: per pass the executor runs
(`keras_pipe.planning.stage_order`), what is alive (held micro-batches,
activations, gradients and their sums, gradients passing through, the
optimizer's temporaries), as coefficients of a `Block`'s sizes
(`stage_sizes.FEATURES`) in four categories (`CATEGORIES`, the fields of
`memory.StageMemory`). The planner evaluates every moment for every
candidate block at once; the stage's peak is the largest.
"""

import numpy as np

from keras_pipe.engine import schedule as schedule_lib
from keras_pipe.planning.backward import CONCURRENT_KERNELS
from keras_pipe.planning.stage_order import executor_order
from keras_pipe.planning.stage_sizes import FEATURES

__all__ = ["CATEGORIES", "moments", "update_temporaries",
           "weight_call_transient"]

CATEGORIES = ("boundary", "activations", "gradients", "transient")


def _unit(name, times=1.0):
    vector = np.zeros(len(FEATURES))
    vector[FEATURES.index(name)] = times
    return vector


def moments(actions, mode, num_micro_batches, first=False, last=False,
            optimizer_slots=0, transposed=False):
    """The moments a stage's peak may fall at, as linear forms of its sizes.

    Each moment is a `(4, len(FEATURES))` array: per category of
    `StageMemory` (boundary, activations, gradients, transient), the
    coefficients of a `Block`'s sizes. The planner evaluates them for every
    candidate block at once. `optimizer_slots` (Adam 2, SGD 0) sets what
    the optimizer step holds (`update_temporaries`); `transposed`: the
    stage's forward products read transposed kernels (`transposes`).
    """
    m = num_micro_batches
    zero = np.zeros(len(FEATURES))
    fixed = zero.copy()
    if first:
        # The mini-batch stays alive all step; micro-batches are its slices.
        fixed = fixed + _unit("inputs", m)
    base = fixed
    if last:
        # Merged outputs and the loss gradient.
        fixed = fixed + _unit("outputs", 2 * m)
    held, sums, result, run = {}, zero, [], []
    released = False
    boundary_of = zero if first else _unit("inputs")

    def remat_of(i):
        return schedule_lib.is_remat(mode, i, m)

    order = executor_order(actions, mode, m)
    # The last stage of a schedule whose backward passes start after every
    # forward pass (GPipe) seeds them from the loss of the merged outputs:
    # the loss gradient is one buffer of `m` micro-batches (in `fixed`)
    # whose rows each backward pass reads (slices along the batch share
    # it), not a gradient per micro-batch arriving.
    kinds = [k for k, _ in order]
    whole_seed = last and "F" in kinds and not any(
        k != "F" for k in kinds[:len(kinds) - kinds[::-1].index("F")])
    arriving = zero if whole_seed else _unit("outputs")
    # The gradient of the stage's last call's output is the one arriving
    # (or, seeded whole, a slice of the loss gradient): a split backward's
    # stash holds it without a copy of its own.
    seeded = _unit("seeded")
    done = 0
    starts = []   # per pass of `order`, the index of its first moment
    for n, (kind, i) in enumerate(order):
        starts.append(len(result))
        remat = remat_of(i)
        boundary = sum((v[0] for v in held.values()), zero)
        kept = sum((v[1] for v in held.values()), zero)
        if kind == "F":
            # In place under a tape, a forward pass keeps what the gradient
            # ops need, as a recompute does.
            held[i] = (boundary_of, zero if remat else _unit("recompute"))
            making = _unit("largest", 2) if remat else (
                _unit("recompute") + _unit("largest"))
            # Seeded whole, the loss and its gradient come after every
            # forward pass: until then the last stage holds the outputs of
            # the earlier micro-batches (the one being made is `making`'s).
            result.append(np.stack([
                boundary + boundary_of, kept + making, sums,
                base + _unit("outputs", done) if whole_seed
                else fixed + _unit("outputs")]))
            done += 1
            if whole_seed and done == m:
                # The merge and the loss: the micro-batches' outputs
                # concatenated (at M = 1 the output itself), then the loss
                # gradient; every micro-batch's tape still held.
                result.append(np.stack([
                    boundary + boundary_of, kept + held[i][1], sums,
                    fixed]))
            continue
        # The stage's last call that makes weight gradients (a W call, the
        # executor's or the schedule's): each variable's gradient waits for
        # the update of the one before (`engine.release`), so about one new
        # gradient is alive besides the old sums: counted as the largest
        # two.
        final = kind in ("Wg", "W") and not any(
            k in ("B", "Bi", "W") for k, _ in order[n + 1:])
        one_by_one = (sums if sums.any() else zero) + _unit(
            "largest_variable") + _unit("second_variable")
        if kind == "Wg":
            run.append(i)
            if n + 1 < len(order) and order[n + 1][0] == "Wg":
                continue
            # W: per mixing op, its inputs and output gradients of the
            # run concatenated, one product per weight into the sums.
            grads = _unit("trainable", 2 if sums.any() else 1)
            if final:
                grads, released = one_by_one, True
            result.append(np.stack([
                boundary, kept, grads,
                fixed + weight_call_transient(len(run))]))
            for r in run:
                held.pop(r, None)
            run, sums = [], _unit("trainable")
            continue
        waiting = arriving * (len(held) - 1)
        if kind == "Bi":
            # Input gradients only; the stash (the mixing ops' inputs, kept
            # anyway, and output gradients) stays for the W call. No
            # scratch buffer: a conv's input gradient (Conv2DBackpropInput)
            # allocates none, only the filter gradient's im2col buffer is
            # one. With remat (a stage's last backward pass is split,
            # `engine.weight_calls`) the call recomputes what a forward
            # pass in place keeps.
            result.append(np.stack([
                boundary, kept + _unit("mixing") - seeded
                + (_unit("recompute") if remat else zero), sums,
                fixed + arriving + _unit("largest") + waiting]))
            # Seeded whole, the stashed output gradient is the loss
            # gradient's slice (in `fixed`); else the arrived gradient.
            held[i] = (held[i][0], _unit("stash") - (
                seeded if whole_seed else zero))
            continue
        if remat:
            # One traced call: recompute, backward, and the running sums,
            # `(..., sums) -> (..., new sums)`: the call's inputs stay
            # alive until it returns, so old and new sums coexist.
            recompute = _unit("recompute")
            grads = _unit("trainable", 2 if sums.any() else 1)
            passing = arriving + _unit("inputs") + _unit("largest")
        else:
            # The tape returns every weight gradient, then they are added;
            # the micro-batch's kept activations are freed as its
            # gradients are made.
            recompute = zero
            grads = _unit("trainable", 2 if sums.any() else 1)
            passing = arriving + _unit("largest")
        # The next stage may run ahead: gradients for the outputs of the
        # other micro-batches in flight can have arrived and be waiting.
        if final:  # the schedule's own W, the stage's last
            grads, released = one_by_one, True
        result.append(np.stack([
            boundary, kept + recompute, grads,
            fixed + passing + waiting
            + _unit("workspace", CONCURRENT_KERNELS)]))
        # A broadcast kernel's gradient (`broadcast_bytes`): made when the
        # backward pass reaches its call, once the tape's tensors of the
        # calls after it are freed.
        result.append(np.stack([
            boundary, kept + recompute - _unit("after_broadcast"), grads,
            fixed + passing + waiting + _unit("broadcast")]))
        held.pop(i, None)
        sums = _unit("trainable")
    in_place = [n for n, (kind, i) in enumerate(order)
                if kind == "F" and not remat_of(i)]
    if transposed and in_place:
        # Made by the first forward call run in place, read by each: alive
        # to the last one's products (not its merge and loss).
        for moment in result[starts[in_place[0]]:starts[in_place[-1]] + 1]:
            moment[3] = moment[3] + _unit("transposed")
    if released:
        # Updates in turn, each freeing its gradient: one gradient applied
        # while the next is made, and the update's temporaries. Plain SGD
        # has none: its `lr * g` runs in the gradient's own buffer (TF
        # forwards a buffer to the op that reads it last): the next
        # gradient made is at most the second largest. Adam's are one more
        # variable's size.
        result.append(np.stack([
            zero, zero, _unit("largest_variable"),
            fixed + (_unit("largest_variable", 2) if optimizer_slots
                     else _unit("second_variable"))]))
        return np.unique(np.stack(result), axis=0)
    # The optimizer step: summed gradients and the update's temporaries.
    result.append(np.stack([zero, zero, _unit("trainable"),
                            fixed + update_temporaries(optimizer_slots)]))
    return np.unique(np.stack(result), axis=0)




def weight_call_transient(run_length):
    """What a W call (`engine.weight_grad`) over a run of `run_length`
    micro-batches holds besides their stashes (`kept`) and the gradient
    sums, as a linear form of a `Block`'s sizes.

    A W of one micro-batch reads its stash as it is: its products run two
    at a time (`CONCURRENT_KERNELS` scratch buffers). A run of two or more
    concatenates each mixing op's stashed inputs and output gradients
    (one product for the run). A concatenation frees its pieces once made
    (the step's graph holds nothing else of them), so the stash changes
    form, not size: beyond it, one slot is being concatenated (its pieces
    and the result, `run_length` largest outputs) while one product runs
    (one scratch buffer); the executor's second inter-op thread runs the
    concatenations the next products wait for.
    """
    # A broadcast kernel's gradient (`broadcast_bytes`) is per row of the
    # run's concatenated inputs.
    if run_length > 1:
        return _unit("largest", run_length) + _unit("workspace") + _unit(
            "broadcast", run_length)
    return _unit("workspace", CONCURRENT_KERNELS) + _unit("broadcast")


def update_temporaries(optimizer_slots):
    """What the optimizer step holds besides the summed gradients, as a
    linear form of a `Block`'s sizes.

    The step updates every variable in one traced function; TF's executor
    runs two variables' chains at a time (inter-op threads) and inlines an
    op's consumer, so a plain SGD step holds two products `lr * g`: two
    largest variables. An optimizer with slots (Adam) reads and updates its
    slots per variable in chains the executor starts for every variable
    before it finishes one, so about one buffer per trainable variable is
    alive at once, plus the two in progress (checked against the BFC
    allocator's peak of `optimizer.apply` in a `tf.function`).
    """
    form = _unit("largest_variable", 2)
    if optimizer_slots:
        form = form + _unit("trainable")
    return form

