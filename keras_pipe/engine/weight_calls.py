"""Where the executor issues weight-gradient calls (`"W"`) of its own.

A schedule's `"B"` without a `"W"` computes the input and the weight
gradients in one call. The executor splits some of them (pure Python, no
TF; the memory model and the simulator place the calls the same way):

* without remat, runs of backward passes fed back to back leave their
  weight gradients to one `"W"` at the run's end, and every other one
  whose input gradient goes to another device gets its `"W"` right after
  it (`keras_pipe.engine.schedule.defer_weight_runs`);
* each stage's last backward pass, if still whole, gets its `"W"` right
  after it (`split_last_backward`): a stage's weight gradients are final
  there, and made by a `"W"` call in place, one variable at a time, each
  is applied and freed before the next is made
  (`keras_pipe.engine.release`). A whole backward pass makes them all at
  once: with remat it is one traced call (recompute, gradients, running
  sums), and a taped one makes every gradient before the sums and the
  updates that read them.

Other backward passes with remat stay whole: a split one would stash the
mixing ops' inputs, which the recompute exists to free.
"""

from keras_pipe.engine.schedule import Action, defer_weight_runs

__all__ = ["last_backward", "place_weight_calls", "split_last_backward"]


def place_weight_calls(actions, device_of, stage_of, remat, num_stages=None):
    """The actions with the executor's own `"W"` actions inserted.

    ```python
    >>> from keras_pipe.engine.schedule import gpipe
    >>> actions = place_weight_calls(     # remat "except_last", M = 2
    ...     [a for t in gpipe(2, 2) for a in t], lambda a: a.j,
    ...     lambda a: a.j, lambda a: a.i == 0, num_stages=2)
    >>> [str(a) for a in actions if a.j == 1]
    ['1F0', '1F1', '1B1', '1W1', '1B0', '1W0']
    ```

    Args:
        actions: the actions in issue order.
        device_of: `device_of(action)`, a key of the device that runs it.
        stage_of: `stage_of(action)`, a key of the stage whose weights it
            updates (with replicas: the replica's stage).
        remat: `remat(action)`, whether that micro-batch's forward pass is
            recomputed on its stage.
        num_stages: `K`, as `defer_weight_runs` takes it. Defaults to
            `None`.

    Returns:
        The actions in issue order, `"W"` actions inserted.
    """
    split = {(a.i, a.j) for a in actions if a.kind == "W"}
    actions = defer_weight_runs(
        actions, device_of,
        lambda a: (a.i, a.j) not in split and not remat(a), num_stages)
    return split_last_backward(actions, stage_of)


def split_last_backward(actions, stage_of):
    """Splits each stage's last backward pass if it is whole.

    Where a stage's last `"B"` or `"W"` is a `"B"` without a `"W"`, a `"W"`
    follows it right away: `"B"` makes the input gradients (sent back at
    once) and `"W"` the weight gradients.

    ```python
    >>> from keras_pipe.engine.schedule import gpipe
    >>> actions = [a for t in gpipe(2, 1) for a in t]
    >>> [str(a) for a in split_last_backward(actions, lambda a: a.j)]
    ['0F0', '0F1', '0B1', '0B0', '0W0']
    ```

    Args:
        actions: the actions in issue order.
        stage_of: `stage_of(action)`, as `place_weight_calls` takes it.

    Returns:
        The actions with `"W"` actions inserted.
    """
    has_w = {(a.i, a.j) for a in actions if a.kind == "W"}
    split = {n for n in last_backward(actions, stage_of).values()
             if actions[n].kind == "B"
             and (actions[n].i, actions[n].j) not in has_w}
    return [b for n, a in enumerate(actions)
            for b in [a] + ([Action("W", a.i, a.j)] if n in split else [])]


def last_backward(actions, stage_of):
    """Per stage (`stage_of(action)`), the position in `actions` of its last
    `"B"` or `"W"`: the call that makes its final weight gradients."""
    last = {}
    for n, a in enumerate(actions):
        if a.kind in ("B", "W"):
            last[stage_of(a)] = n
    return last
