"""The sampler of `PipelineModel.generate`, given to `compile(sampler=...)`.

A KerasHub `CausalLM` takes `compile(sampler=...)` (a name or a
`keras_hub.samplers.Sampler`) and its `generate` picks each token with it;
a pipeline cut from one takes the same argument, and its `generate` uses
that sampler in preference to the task's. The pipelined decode loop asks
the sampler for one token at a time (`compute_probabilities`, then
`get_next_token`) inside its own loop, so a sampler that runs its own loop
over the whole sequence (its own `__call__`: beam search, contrastive,
speculative) cannot be pipelined: it is refused here, at `compile`, before
anything is built or traced. KerasHub is imported only when a sampler is
given, so that a pipeline without one needs no KerasHub.
"""

import keras

__all__ = ["resolve", "serialize"]

_NAMES = "'greedy', 'top_k', 'top_p', 'random'"


def resolve(sampler):
    """The `keras_hub.samplers.Sampler` for `sampler` (None stays None).

    Raises:
        ImportError: if a sampler is given and KerasHub is not installed.
        TypeError: if `sampler` is neither a string nor a Sampler.
        ValueError: if it names no KerasHub sampler, or is one that runs
            its own loop over the sequence.
    """
    if sampler is None:
        return None
    try:
        import keras_hub  # noqa: PLC0415 - only for a pipeline that samples
    except ImportError as exc:
        raise ImportError(
            "compile(sampler=...) needs KerasHub: the sampler is for "
            "PipelineModel.generate of a pipeline cut from a KerasHub "
            f"CausalLM. Received: sampler={sampler!r}") from exc
    base = keras_hub.samplers.Sampler
    if isinstance(sampler, str):
        try:
            resolved = keras_hub.samplers.get(sampler)
        except (KeyError, ValueError) as exc:
            resolved = exc
        if not isinstance(resolved, base):
            raise ValueError(
                f"Unknown sampler {sampler!r}: compile(sampler=...) takes "
                f"the lowercase name of a KerasHub sampler ({_NAMES}) or a "
                "keras_hub.samplers.Sampler instance, such as "
                "keras_hub.samplers.TopKSampler(k=5, seed=0). Received: "
                f"sampler={sampler!r}") from None
    elif isinstance(sampler, base):
        resolved = sampler
    else:
        kind = ("a class; pass an instance, "
                f"{sampler.__name__}(...)" if isinstance(sampler, type)
                else f"a {type(sampler).__name__}")
        raise TypeError(
            "compile(sampler=...) takes a sampler name "
            f"({_NAMES}) or a keras_hub.samplers.Sampler instance; "
            f"this is {kind}. Received: sampler={sampler!r}")
    if type(resolved).__call__ is not base.__call__:
        raise ValueError(
            f"{type(resolved).__name__} runs its own loop over the whole "
            "sequence, which PipelineModel.generate cannot pipeline: it "
            "picks one token at a time with the sampler's "
            "compute_probabilities and get_next_token. Use a sampler that "
            f"does ({_NAMES}, or a Sampler subclass that overrides "
            "get_next_token but not __call__), or generate with the unsplit model "
            f"(pipe.to_model().generate). Received: sampler={sampler!r}")
    return resolved


def serialize(sampler, resolved):
    """What the compile config keeps of `sampler` (`resolve`d as
    `resolved`): a name as given, else the Sampler's Keras config."""
    if isinstance(sampler, str):
        return sampler
    return keras.saving.serialize_keras_object(resolved)
