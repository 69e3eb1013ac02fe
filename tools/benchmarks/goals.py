"""The goals each part reports against (reported, never asserted)."""


# Reported, never asserted.
GOALS = {
    "a": ("best speedup over schedules and M on 2 pinned workers over 1 "
          "process on 1 core", ">=", 1.6),
    "a-overhead": ("keras_pipe GPipe step / bare TF graph GPipe step, same "
                   "M, worst M", "<=", 1.05),
    "a-cpu": ("workers' CPU s per step / 1-core process's, M=8, the best "
              "schedule at M=8", "<=", 1.15),
    "b": ("step time of PipelineModel(K=1, M=1) / plain Keras model",
          "<=", 1.05),
    "c": ('peak memory remat="always" / "never", K=4, M=8, activations '
          "dominate", "<=", 0.5),
    "c*": ('the same, weights and their gradients weigh more', "<=", 0.5),
    "d": ("build time of the training step, K=8 M=32 / K=8 M=4", "<=", 2.0),
    "e": ("step time / (M+K-1) stage times, worst configuration "
          "(|ratio - 1|)", "<=", 0.05),
}


def check_goal(key, measured):
    """`{"goal", "bound", "measured", "met"}` for the goal `key` of GOALS."""
    text, op, bound = GOALS[key]
    met = None
    if measured is not None:
        met = measured >= bound if op == ">=" else measured <= bound
    return {"goal": text, "bound": f"{op} {bound:g}", "measured": measured,
            "met": met}

