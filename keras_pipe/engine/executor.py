"""The executor: runs any schedule's actions over the stage runners.

One training step is a list of stage calls. The executor reads the clock
ticks of the model's schedule (`keras_pipe.schedule`), issues each action in
tick order (`"F"` a forward call, `"B"` a backward call, `"W"` the weight
gradients) and chains the calls of each device with control dependencies,
so that each device runs its calls in the schedule's order. Everything a
step builds lives in a typed `Step`, indexed by (micro-batch `i`, stage
`j`): the `StageRun` of each forward call, the gradients flowing back, the
threaded state, and one running sum per trainable variable per stage.

The loss head decides how gradients are seeded. When the first backward call
of the last stage comes after every forward call (GPipe), the loss is
computed once on the merged outputs of all micro-batches, which is exact for
every loss. Otherwise (1F1B and the other interleaved schedules) micro-batch
`i` is seeded from its own part of the full-batch loss (see
`keras_pipe.engine.losses`), computed on its rows as soon as it left the last stage.

The executor knows nothing of Keras' `Model`: the model hands it a
`LossHead` (what to call for the full loss and for one micro-batch's part),
and an observer (the Timeline's recorder) that stamps the calls.
"""

import dataclasses

import keras
import tensorflow as tf

from keras_pipe import _compat
from keras_pipe.engine import attached, microbatch, products, release
from keras_pipe.engine import schedule as schedule_lib
from keras_pipe.engine.gradients import sum_gradients, sum_micro_batches
from keras_pipe.engine.replicas import replica_of
from keras_pipe.engine.tensors import is_float
from keras_pipe.engine.weight_calls import last_backward, place_weight_calls

__all__ = ["Cell", "Executor", "LossHead", "Step", "sum_on_devices"]


@dataclasses.dataclass
class LossHead:
    """How the model turns stage outputs into a loss (see module docstring).

    Attributes:
        full: `full(y_pred) -> loss`, the compiled loss of the merged
            outputs (it may update loss metrics).
        part: `part(step, i) -> loss_i`, micro-batch `i`'s exact part of the
            full-batch loss, computed from its own outputs.
        scale: `scale(loss)`, the optimizer's loss scaling (mixed precision).
    """

    full: object
    part: object
    scale: object


@dataclasses.dataclass
class Cell:
    """What micro-batch `i` left on stage `j` during a step."""

    run: object = None           # the `StageRun` of the forward call (its
    #                              outputs: `keras_pipe.engine.attached.keep(...)`)
    output_grads: list = None    # gradients for `tree.flatten(run.outputs)`
    loss_grads: list = None      # gradients for `run.losses`
    split: bool = False          # a "W" action follows its "B"
    deferred: bool = False       # that "W" is the executor's (end of a run)
    stash: object = None         # B's stash for W (split backward)
    sent: object = None          # `run.outputs` as the next stage reads them


@dataclasses.dataclass
class Step:
    """The state of one pipelined step, indexed by micro-batch and stage.

    Attributes:
        micro_batches: the `MicroBatch`es of the step (all replicas).
        training: the `training` flag of the stage calls.
        differentiable: whether an outer `tf.GradientTape` sees the calls
            (`model(x)` under a tape), else the executor's own backward
            calls compute the gradients.
        remat: per stage, `"always"`, `"except_last"` or `"never"`.
        replica: per micro-batch, the replica that runs it.
        cells: `cells[i][j]`, a `Cell` per micro-batch and stage.
        params: `params[r][j]`, the trainable values stage `j` of replica
            `r` reads, once per step, on its device.
        start_state: `start_state[j]`, stage `j`'s state values at the
            start of the step.
        state: `state[r][j]`, the current state values of stage `j` as
            replica `r` threads them (see `Stage.state_kinds`: seed states
            stay at the start value, moving statistics are threaded per
            replica, other state from call to call across replicas).
        new_seeds: `new_seeds[j][s]`, the advanced seed state (the same
            from every micro-batch), or None.
        updates: `updates[r][j][s]`, how many micro-batches of replica `r`
            updated state value `s` (int or tensor; padding slots do not).
        sums: `sums[r][j]`, per trainable variable of the stage, the running
            sum of its gradients (None until the first one).
        last: per device, the tensors of the last call issued there: the
            next call on that device waits for them.
        weight_calls: `weight_calls[(r, j)]`, the ops and the running sums
            of the last W call of stage `j` of replica `r`.
        final_weights: the `(i, j)` whose W call makes the final sums of
            stage `j` (of `i`'s replica): that call runs in place.
        total_rows: the rows of the global batch (int or scalar tensor).
        kernels: `kernels[(r, j)]`, stage `j`'s kernels transposed for
            replica `r`'s forward calls (`keras_pipe.engine.products`),
            where that pays.
        loss: the full-batch loss, once computed within the step.
        seeded_by_parts: whether micro-batches are seeded from their own
            parts of the loss (some backward call starts before the last
            forward call).
    """

    micro_batches: list
    training: bool
    differentiable: bool
    remat: list
    replica: list
    cells: list
    params: list
    start_state: list
    state: list
    new_seeds: list
    updates: list
    sums: list
    total_rows: object = None
    last: dict = dataclasses.field(default_factory=dict)
    loss: object = None
    seeded_by_parts: bool = False
    weight_calls: dict = dataclasses.field(default_factory=dict)
    final_weights: set = dataclasses.field(default_factory=set)
    kernels: dict = dataclasses.field(default_factory=dict)
    _shares: dict = dataclasses.field(default_factory=dict)

    @property
    def num_micro_batches(self):
        return len(self.micro_batches)

    def shares(self, dtype):
        """Each micro-batch's share of the batch's rows, built once."""
        key = tf.as_dtype(dtype).name
        if key not in self._shares:
            self._shares[key] = _shares(self.micro_batches, dtype)
        return self._shares[key]




def _shares(micro_batches, dtype):
    """Each micro-batch's share of the batch's rows (0 for a padding slot)."""
    sizes = [tf.cast(mb.size, dtype) for mb in micro_batches]
    total = tf.add_n(sizes) if len(sizes) > 1 else sizes[0]
    return [size / total for size in sizes]


def _total_rows(micro_batches):
    sizes = [mb.size for mb in micro_batches]
    if all(isinstance(n, int) for n in sizes):
        return sum(sizes)
    return tf.add_n([tf.cast(n, tf.int32) for n in sizes])


def _handed_over(tensors, device, receiver, name):
    """`tensors` as another device reads them: through an Identity here.

    TF's executor runs the successors of a finished op in a fixed order: its
    data edges, then its control edges, and it keeps the last expensive one
    for the running thread and queues the others on that thread's own
    queue. The next call on a device waits (control edge) for the last
    call's output, so a transfer (`_Send`, counted expensive) of that output
    would wait in the queue until the device's chain of calls ran dry:
    measured on 2 single-core workers, the next stage received micro-batch
    0 only after the sender had run micro-batches 1 and 2. Through a cheap
    Identity, run at once in line, the `_Send` follows right away.
    """
    if receiver == device:
        return tensors
    with tf.device(device), tf.name_scope(name):
        return keras.tree.map_structure(
            lambda t: t if not isinstance(t, tf.Tensor) else tf.identity(t),
            tensors)


def _done(tensors, device, name):
    """What the next call on `device` waits for: every one of `tensors`.

    `tensors` are all the outputs of the last call there. TF inlines the
    calls that run in place, so waiting for one output waits only for the
    ops that produce it: the rest of the call (a backward call's weight
    gradients and their running sums) would still run, holding its
    activations, while the next call starts, and the calls of a device
    would not run one after another as the memory model assumes. Several
    tensors are joined by one `NoOp` on the device: the next call's first
    ops then each get one control input, not one per tensor.
    """
    tensors = [t for t in tensors if t is not None]
    if len(tensors) <= 1:
        return tensors
    with tf.device(device):
        return [tf.group(*tensors, name=f"{name}_done")]


class Executor:
    """Runs a schedule's actions over the stage runners of every replica.

    Args:
        replicas: `replicas[r][j]`, the `keras_pipe.engine.stage.Stage` runner of
            stage `j` in replica `r`; replica 0 holds the variables.
        schedule: the name of a registered schedule.
        stage_devices: per stage, the index of its device (in order of
            first appearance), for schedules with several stages per device.
    """

    def __init__(self, replicas, schedule, stage_devices):
        self.replicas = replicas
        self.schedule = schedule
        self.stage_devices = list(stage_devices)

    @property
    def num_stages(self):
        return len(self.replicas[0])

    @property
    def num_replicas(self):
        return len(self.replicas)

    def ticks(self, num_micro_batches):
        """The schedule's clock ticks for one replica's micro-batches."""
        return schedule_lib.build_ticks(self.schedule, num_micro_batches,
                                        self.num_stages,
                                        1 + max(self.stage_devices))

    def runner(self, step, i, j):
        return self.replicas[step.replica[i]][j]

    # ------------------------------------------------------------- a step

    def loss_and_gradients(self, inputs, num_micro_batches, training, remat,
                           head, variables, device_of, weight_loss=None,
                           observer=None, weight_ops=None):
        """One forward and backward pass of the schedule, no optimizer step.

        Args:
            inputs: the batch's inputs (a nested structure of tensors).
            num_micro_batches: `M` per replica.
            training: the `training` flag of the stage calls.
            remat: per stage, `"always"`, `"except_last"` or `"never"`.
            head: the model's `LossHead`.
            variables: the trainable variables to return gradients for.
            device_of: `device_of(variable)`, where its gradient is summed.
            weight_loss: the regularization losses of the weights (a scalar
                that reaches the variables directly), or None.
            observer: stamps every stage call (the Timeline's recorder).
            weight_ops: a dict to fill with `{id(variable): ops}`, the ops
                that compute only that variable's gradient in a W call run
                in place (for `keras_pipe.engine.release.apply_in_turn`),
                or None.

        Returns:
            `(loss, y_pred, gradients)`: the full-batch loss, the merged
            outputs and one gradient (or None) per variable.
        """
        step = self.start(inputs, num_micro_batches, training, remat,
                          differentiable=False)
        self.run(step, head, observer=observer)
        self.assign_state(step)
        y_pred = self.outputs(step)
        loss = step.loss
        if loss is None:  # seeded by parts: the full loss for metrics
            loss = self._full_loss(step, head, y_pred)
        parts = list(self.gradient_parts(step))
        if weight_loss is not None:
            # Differentiated on its own: the gradient of the total loss
            # would walk the whole forward graph again.
            direct = tf.gradients(head.scale(weight_loss), variables,
                                  unconnected_gradients="none")
            parts += [(v, g) for v, g in zip(variables, direct)
                      if g is not None]
        if weight_ops is not None:
            weight_ops.update(self._weight_ops(step))
        return loss, y_pred, sum_on_devices(variables, parts, device_of)

    def _weight_ops(self, step):
        """`{id(variable): ops}`: the ops of the stages' last W calls that
        compute only that variable's final sum (one replica only)."""
        if self.num_replicas > 1:
            return {}
        found, shared = {}, set()
        for (r, j), (ops, totals) in step.weight_calls.items():
            sums = step.sums[r][j]
            if any(s is not t for s, t in zip(sums, totals)):
                continue  # summed again after the W call
            variables = self.replicas[r][j].trainable_variables
            for v, own in zip(variables, release.exclusive_ops(ops, sums)):
                if id(v) in found:
                    shared.add(id(v))
                if own:
                    found[id(v)] = own
        return {k: v for k, v in found.items() if k not in shared}

    def start(self, inputs, num_micro_batches, training, remat,
              differentiable):
        """Splits the batch; reads weights and state once per step."""
        micro_batches = microbatch.scatter(
            inputs, num_micro_batches * self.num_replicas)
        m, k = len(micro_batches), self.num_stages
        start = [r.read_state() for r in self.replicas[0]]
        r_count = self.num_replicas
        return Step(
            micro_batches=micro_batches, training=training,
            differentiable=differentiable, remat=list(remat),
            replica=[replica_of(i, m, self.num_replicas) for i in range(m)],
            cells=[[Cell() for _ in range(k)] for _ in range(m)],
            params=[[r.read_params(differentiable) for r in replica]
                    for replica in self.replicas],
            start_state=start,
            state=[[list(s) for s in start] for _ in range(r_count)],
            new_seeds=[[None] * len(s) for s in start],
            updates=[[[0] * len(s) for s in start] for _ in range(r_count)],
            sums=[[[None] * len(r.trainable_variables) for r in replica]
                  for replica in self.replicas],
            total_rows=_total_rows(micro_batches))

    def _shards(self, step):
        """Per replica, the global indices of its micro-batches."""
        shards = [[] for _ in self.replicas]
        for i, r in enumerate(step.replica):
            shards[r].append(i)
        return [s for s in shards if s]

    def actions(self, step, forward_only=False):
        """The step's actions in issue order, with global micro-batch ids.

        Each replica follows the schedule on its own micro-batches; their
        ticks are merged tick by tick.
        """
        per_replica = []
        for shard in self._shards(step):
            ticks = (schedule_lib.gpipe(len(shard), self.num_stages)
                     if forward_only else self.ticks(len(shard)))
            per_replica.append([[dataclasses.replace(a, i=shard[a.i])
                                 for a in tick
                                 if not forward_only or a.kind == "F"]
                                for tick in ticks])
        merged = []
        for k in range(max(len(t) for t in per_replica)):
            merged += [a for ticks in per_replica if k < len(ticks)
                       for a in ticks[k]]
        return merged

    def forward(self, step, observer=None):
        """Runs every forward call (GPipe order): inference and `call`."""
        for action in self.actions(step, forward_only=True):
            self._forward(step, action.i, action.j, observer)

    def forward_batches(self, batches, num_micro_batches, training=False,
                        observer=None):
        """Forward calls of several batches as one stream of micro-batches.

        Inference: each batch is cut into `num_micro_batches` micro-batches
        (per replica) and all of them follow one GPipe forward order, so
        that the pipeline fills once per call, not once per batch. The
        calls of a device are chained across batches; weights are read once.

        Returns:
            One `Step` per batch, its state assigned (`outputs(step)` reads
            its merged outputs).
        """
        # No backward pass follows: remat "always" only makes each stage
        # call one traced function op, with no tape (`Stage.forward`).
        steps = [self.start(x, num_micro_batches, training,
                            ["always"] * self.num_stages,
                            differentiable=False)
                 for x in batches]
        for step in steps[1:]:  # one read, one chain per device
            step.params, step.kernels = steps[0].params, steps[0].kernels
            step.last = steps[0].last
        stream = [(s, i) for s, step in enumerate(steps)
                  for i in range(step.num_micro_batches)]
        for tick in schedule_lib.gpipe(len(stream), self.num_stages):
            for action in tick:
                if action.kind == "F":
                    s, i = stream[action.i]
                    self._forward(steps[s], i, action.j, observer)
        for step in steps:
            self.assign_state(step)
        return steps

    def run(self, step, head, observer=None):
        """Runs the schedule's forward, backward and weight calls.

        Consecutive `"W"` actions of one stage on a device run as one call
        over their micro-batches (`keras_pipe.engine.weight_grad`: one product
        over the concatenated micro-batches where that is exact).
        """
        actions = self._with_deferred_weights(step, self.actions(step))
        for a in actions:
            if a.kind == "W":
                step.cells[a.i][a.j].split = True
        step.final_weights = {
            (actions[n].i, actions[n].j)
            for n in last_backward(
                actions, lambda a: (step.replica[a.i], a.j)).values()
            if actions[n].kind == "W"}
        # Seeds come from each micro-batch's own part of the loss when a
        # backward call starts before the last forward call, and with
        # replicas (the full-batch loss would join them); else from the
        # full-batch loss once.
        last_forward = max(n for n, a in enumerate(actions) if a.kind == "F")
        step.seeded_by_parts = self.num_replicas > 1 or any(
            a.kind == "B" for a in actions[:last_forward])
        pending = {}  # device -> [(i, j)]: W actions not yet issued
        for action in actions:
            i, j = action.i, action.j
            device = self.runner(step, i, j).device
            group = pending.get(device)
            if group and (action.kind != "W" or action.j != group[0][1]
                          or step.replica[i] != step.replica[group[0][0]]):
                self._weight(step, pending.pop(device), observer)
            if action.kind == "F":
                self._forward(step, i, j, observer)
                if j == self.num_stages - 1:
                    self._maybe_seed_part(step, head, i)
            elif action.kind == "B":
                self._backward(step, i, j, head, observer)
            else:
                pending.setdefault(device, []).append((i, j))
        for group in pending.values():
            self._weight(step, group, observer)

    def _with_deferred_weights(self, step, actions):
        """Backward calls without remat split; runs fed back to back defer W.

        GPipe's backward phase keeps every micro-batch of the run in flight
        anyway and its input gradients arrive back to back; without remat,
        each `"B"` then computes the input gradients only and one `"W"` call
        after the run computes the weight gradients of all of them as one
        product over the concatenated micro-batches
        (`keras_pipe.engine.weight_grad`), instead of one product per
        micro-batch added to a running sum. It also holds each mixing op's
        output gradient until then (peak memory: README, "Schedules").
        Every other backward call without remat (1F1B's, whose drain waits
        for the next stage micro-batch by micro-batch) is followed by its
        own `"W"` call: its input gradients leave before its weight
        gradients are computed, and no `"W"` waits behind a later `"B"`
        (`schedule_lib.defer_weight_runs` with `num_stages`). With remat,
        the stash would hold what the recompute frees, so those calls stay
        fused. Each stage's last backward call is split in any case: its
        weight gradients are the stage's final sums, made by a W call in
        place (`_weight`), so that each can be applied and freed before the
        next is made (`keras_pipe.engine.weight_calls`,
        `keras_pipe.engine.release`).
        """
        if step.differentiable:
            return actions
        split = {(a.i, a.j) for a in actions if a.kind == "W"}

        def device_of(a):  # a run stays within one replica
            return (self.runner(step, a.i, a.j).device, step.replica[a.i])

        actions = place_weight_calls(
            actions, device_of, lambda a: (step.replica[a.i], a.j),
            lambda a: self._remat(step, a.i, a.j), self.num_stages)
        for a in actions:
            if a.kind == "W" and (a.i, a.j) not in split:
                step.cells[a.i][a.j].deferred = True
        return actions

    # ------------------------------------------------------------- forward

    def _remat(self, step, i, j):
        return schedule_lib.is_remat(step.remat[j], i, step.num_micro_batches)

    def _forward(self, step, i, j, observer):
        """Issues the forward call of micro-batch `i` on stage `j`."""
        runner = self.runner(step, i, j)
        x = (step.micro_batches[i].inputs if j == 0
             else step.cells[i][j - 1].sent)
        r = step.replica[i]
        state = list(step.state[r][j])
        if any(kind == "seed" for kind, _ in runner.state_kinds):
            # Random draws keyed by the rows' places in the global batch.
            micro_batch = step.micro_batches[i]
            with tf.device(runner.device):
                state.append(tf.stack([
                    tf.cast(micro_batch.offset, tf.int32),
                    tf.cast(step.total_rows, tf.int32)]))
        run, new_state = runner.forward(
            x, step.params[r][j], state, step.training,
            self._remat(step, i, j),
            control_inputs=step.last.get(runner.device, []),
            differentiable=step.differentiable,
            name=f"stage{j}/mb{i}/forward", observer=observer,
            split=step.cells[i][j].split, kernels=self._kernels(step, i, j))
        step.last[runner.device] = _done(
            keras.tree.flatten(run.outputs) + list(run.losses) + new_state,
            runner.device, f"stage{j}/mb{i}/forward")
        self._thread_state(step, i, j, runner, new_state)
        step.cells[i][j].run = run
        step.cells[i][j].sent = run.outputs if j + 1 == self.num_stages \
            else _handed_over(run.outputs, runner.device,
                              self.runner(step, i, j + 1).device,
                              f"stage{j}/mb{i}/send")

    def _kernels(self, step, i, j):
        """Stage `j`'s kernels transposed once for replica `r`'s forward
        calls of the step, if those run in place on small micro-batches
        (`keras_pipe.engine.products.transposes`), else None."""
        if step.differentiable or self._remat(step, i, j):
            return None
        r = step.replica[i]
        if (r, j) not in step.kernels:
            # The rows of the calls that run in place (remat "except_last":
            # the last one only) pay for the transposes.
            sizes = [mb.size for ii, mb in enumerate(step.micro_batches)
                     if step.replica[ii] == r
                     and not self._remat(step, ii, j)]
            step.kernels[(r, j)] = (
                products.TransposedKernels(step.params[r][j])
                if products.transposes(sizes, self.runner(step, i, j).device)
                else None)
        return step.kernels[(r, j)]

    def _thread_state(self, step, i, j, runner, new_state):
        """Records micro-batch `i`'s state updates on stage `j`."""
        r, valid = step.replica[i], step.micro_batches[i].valid
        for s, new in enumerate(new_state):
            if new is None:
                continue
            kind, _ = runner.state_kinds[s]
            if kind == "seed":
                if step.new_seeds[j][s] is None:
                    step.new_seeds[j][s] = new
                continue
            old = step.state[r][j][s]
            if valid is not True:
                with tf.device(runner.device):
                    new = tf.where(valid, new, old)
            step.updates[r][j][s] = step.updates[r][j][s] + (
                1 if valid is True else tf.cast(valid, tf.int32))
            replicas = [r] if kind == "ema" else range(self.num_replicas)
            for rr in replicas:
                step.state[rr][j][s] = new

    def _final_state(self, step, j, s):
        """Stage `j`'s state value `s` after the step, or None if unchanged.

        Moving statistics threaded by several replicas are merged as if
        the replicas' micro-batches had run one after another:
        `m = momentum^n_r * m + (m_r - momentum^n_r * m_0)` for replica `r`
        with `n_r` updates, starting from `m_0`, which is exact for
        `m * momentum + x * (1 - momentum)` updates.
        """
        kind, momentum = self.replicas[0][j].state_kinds[s]
        if kind == "seed":
            return step.new_seeds[j][s]
        touched = [r for r in range(self.num_replicas)
                   if not (isinstance(step.updates[r][j][s], int)
                           and step.updates[r][j][s] == 0)]
        if not touched:
            return None
        if kind == "chain" or len(touched) == 1:
            return step.state[touched[-1]][j][s]
        start = step.start_state[j][s]
        merged = step.state[touched[0]][j][s]
        for r in touched[1:]:
            decay = tf.pow(tf.cast(momentum, start.dtype),
                           tf.cast(step.updates[r][j][s], start.dtype))
            merged = decay * merged + (step.state[r][j][s] - decay * start)
        return merged

    def assign_state(self, step):
        """Assigns each stage's final state once; calls the step-end hooks."""
        for j, runner in enumerate(self.replicas[0]):
            with tf.device(runner.device):
                for s, variable in enumerate(runner.state_variables):
                    value = self._final_state(step, j, s)
                    if value is not None:
                        variable.assign(value)
                if step.training:
                    _finish_mini_batch(runner.layer)

    def outputs(self, step):
        """The last stage's outputs, merged over micro-batches, with the
        masks and logits attached again (`keras_pipe.engine.attached.view`)."""
        with tf.device(self.replicas[0][-1].device):
            return attached.view(microbatch.gather(
                [row[-1].run.outputs for row in step.cells],
                step.micro_batches))

    def layer_losses(self, step, dtype):
        """The losses layers added (`add_loss`) during the forward calls.

        Keras divides an activity regularizer by the batch size, and most
        `add_loss` terms are batch means: the full-batch value is the mean
        of the micro-batch values weighted by micro-batch size.
        """
        shares = step.shares(dtype)
        terms = [tf.cast(tf.reduce_sum(l), dtype) * shares[i]
                 for i, row in enumerate(step.cells) for cell in row
                 for l in cell.run.losses]
        return tf.add_n(terms) if terms else None

    # ---------------------------------------------------------------- seeds

    def _maybe_seed_part(self, step, head, i):
        """Seeds micro-batch `i` from its loss part if backward starts early.

        Called when micro-batch `i` left the last stage. Without parts, the
        full-batch loss seeds everything at the first backward call.
        """
        if not step.seeded_by_parts:
            return
        last = self.runner(step, i, self.num_stages - 1)
        # The loss head joins the last stage's chain of calls.
        with tf.device(last.device), tf.control_dependencies(
                step.last.get(last.device, [])):
            loss_i = head.part(step, i)
        self._seed(step, head.scale(loss_i), [i])
        self._seed_layer_losses(step, head.scale, [i])
        step.last[last.device] = _done(
            step.cells[i][-1].output_grads, last.device, f"mb{i}/loss")

    def _full_loss(self, step, head, y_pred):
        """The full-batch loss of the merged outputs, with the layer losses,
        on the last stage's device."""
        with tf.device(self.replicas[0][-1].device):
            loss = head.full(y_pred)
            extra = self.layer_losses(step, loss.dtype)
            return loss if extra is None else loss + extra

    def _seed_full(self, step, head):
        """The full-batch loss, once; seeds the micro-batches not seeded."""
        step.loss = self._full_loss(step, head, self.outputs(step))
        todo = [i for i, row in enumerate(step.cells)
                if row[-1].output_grads is None]
        self._seed(step, head.scale(step.loss), todo)
        self._seed_layer_losses(step, head.scale, todo)

    def _seed(self, step, loss, indices):
        """Gradients of `loss` for the given micro-batches' stage outputs.

        Only the loss head is differentiated here; each stage's backward
        runs in `Stage.backward` on its device. The gradients are partial
        ones (`stop_gradients`): where one output feeds another (the logits
        behind a softmax output, a head computed from another output), the
        path between them is the stage's, taken once in its backward pass.
        """
        outputs = [keras.tree.flatten(step.cells[i][-1].run.outputs)
                   for i in indices]
        targets = [t for flat in outputs for t in flat if is_float(t)]
        with tf.device(self.replicas[0][-1].device):
            grads = iter(tf.gradients(loss, targets, stop_gradients=targets,
                                      unconnected_gradients="none"))
        for i, flat in zip(indices, outputs):
            step.cells[i][-1].output_grads = [
                next(grads) if is_float(t) else None for t in flat]

    def _seed_layer_losses(self, step, scale, indices):
        """Gradients of the total loss for the stages' `add_loss` terms."""
        shares = step.shares(tf.float32)
        for i in indices:
            for cell in step.cells[i]:
                cell.loss_grads = [
                    scale(tf.ones_like(l) * tf.cast(shares[i], l.dtype))
                    for l in cell.run.losses]

    # -------------------------------------------------------------- backward

    def _backward(self, step, i, j, head, observer):
        """Issues the backward call of micro-batch `i` on stage `j`."""
        cell = step.cells[i][j]
        if j == self.num_stages - 1 and cell.output_grads is None:
            self._seed_full(step, head)
        runner = self.runner(step, i, j)
        sums = step.sums[step.replica[i]][j]
        if cell.split:
            input_grads, cell.stash = runner.backward_input(
                cell.run, cell.output_grads, cell.loss_grads, training=True,
                name=f"stage{j}/mb{i}/backward",
                control_inputs=step.last.get(runner.device, []),
                observer=observer)
            step.last[runner.device] = _done(
                input_grads + list(cell.stash), runner.device,
                f"stage{j}/mb{i}/backward")
            self._send_back(step, i, j, input_grads)
            cell.output_grads = None
            if cell.deferred and not runner.splits(step.training):
                # A stage that runs fused (an LSTM's While, a custom
                # gradient) stashes whole weight gradients: they are added
                # now, not held for every micro-batch of the run.
                self._weight(step, [(i, j)], observer)
            return
        input_grads, totals = runner.backward(
            cell.run, cell.output_grads, cell.loss_grads, training=True,
            totals=list(sums), name=f"stage{j}/mb{i}/backward",
            control_inputs=step.last.get(runner.device, []),
            observer=observer)
        step.last[runner.device] = _done(
            input_grads + totals, runner.device, f"stage{j}/mb{i}/backward")
        self._send_back(step, i, j, input_grads)
        sums[:] = totals
        cell.output_grads = None  # released: nothing reads it again

    def _send_back(self, step, i, j, input_grads):
        """Hands stage `j`'s input gradients to stage `j - 1`, if any."""
        if j:
            step.cells[i][j - 1].output_grads = _handed_over(
                input_grads, self.runner(step, i, j).device,
                self.runner(step, i, j - 1).device,
                f"stage{j}/mb{i}/send_back")

    def _weight(self, step, group, observer):
        """Issues the weight gradients of `group`'s (i, j), one stage, as one
        call that adds them to the stage's running sums."""
        group = [(ii, j) for ii, j in group
                 if step.cells[ii][j].stash is not None]
        if not group:
            return  # added at their backward calls already
        i, j = group[0]
        runner = self.runner(step, i, j)
        sums = step.sums[step.replica[i]][j]
        stashes = [step.cells[ii][j].stash for ii, _ in group]
        graph = tf.compat.v1.get_default_graph()
        first = len(graph.get_operations())
        totals = runner.backward_weight(
            step.params[step.replica[i]][j], stashes, sums, training=True,
            name=f"stage{j}/mb{i}/weight",
            control_inputs=step.last.get(runner.device, []),
            observer=observer,
            in_place=any(cell in step.final_weights for cell in group))
        step.weight_calls[(step.replica[i], j)] = (
            graph.get_operations()[first:], list(totals))
        step.last[runner.device] = _done(
            totals, runner.device, f"stage{j}/mb{i}/weight")
        sums[:] = totals
        for ii, _ in group:
            step.cells[ii][j].stash = None

    def gradient_parts(self, step):
        """`(variable, gradient)` per stage and trainable variable.

        The replicas' sums of a stage are micro-batches of one read: they
        are added on replica 0's device (where the variables live) as
        micro-batches are (`keras_pipe.engine.gradients.add_gradients`).
        """
        for j, runner in enumerate(self.replicas[0]):
            for n, variable in enumerate(runner.trainable_variables):
                parts = [sums[j][n] for sums in step.sums
                         if sums[j][n] is not None]
                if parts:
                    with tf.device(runner.device):
                        total = sum_micro_batches(parts)
                    yield variable, total


def sum_on_devices(variables, parts, device_of):
    """Sums each variable's gradient parts on the variable's device.

    Args:
        variables: the model's trainable variables, in order.
        parts: `(variable, gradient)` pairs, several per variable (stages
            that share a layer, replicas, regularization).
        device_of: `device_of(variable)`, the device to sum on.

    Returns:
        One gradient (or None) per variable.
    """
    index = {id(v): n for n, v in enumerate(variables)}
    collected = [[] for _ in variables]
    for variable, gradient in parts:
        collected[index[id(variable)]].append(gradient)
    gradients = []
    for variable, grads in zip(variables, collected):
        if not grads:
            gradients.append(None)
            continue
        with tf.device(device_of(variable)):
            gradients.append(sum_gradients(grads))
    return gradients


def _finish_mini_batch(layer):
    """Calls `finish_mini_batch()` on each sub-layer of `layer` that has it.

    The hook runs once per training step, after the state of every
    micro-batch has been assigned: a layer that accumulates statistics over
    micro-batches (`keras_pipe.layers.DeferredBatchNormalization`) applies
    them here, once per mini-batch.
    """
    for sub in _compat.flatten_layers(layer):
        finish = getattr(sub, "finish_mini_batch", None)
        if callable(finish):
            finish()
