"""verl's request shapes to kvrunner's and back: a sampling-params dict to
``SamplingParams``, a ``RequestOutput`` to verl's ``TokenOutput``."""

from __future__ import annotations

from typing import Any

from kvrunner.errors import RequestError
from kvrunner.outputs import RequestOutput
from kvrunner.sampling_params import SamplingParams

#: keys verl sends that kvrunner takes as they are
_SAME = ("temperature", "top_p", "top_k", "seed", "ignore_eos", "stop", "stop_token_ids")


def sampling_params(params: dict[str, Any], *, default_max_tokens: int,
                    routed_experts: bool = False) -> SamplingParams:
    """``SamplingParams`` for verl's dict. ``max_tokens`` (or ``max_new_tokens``)
    defaults to ``default_max_tokens``; ``logprobs=True`` asks for each token's
    logprob; a ``repetition_penalty`` other than 1 is refused (kvrunner has none);
    ``routed_experts`` asks for every computed token's experts (routing replay)."""
    params = dict(params)
    kwargs: dict[str, Any] = {k: params.pop(k) for k in _SAME if k in params}
    default = params.pop("max_new_tokens", default_max_tokens)
    kwargs["max_tokens"] = params.pop("max_tokens", default)
    kwargs["logprobs"] = 0 if params.pop("logprobs", False) else None
    penalty = params.pop("repetition_penalty", 1.0)
    if penalty != 1.0:
        raise RequestError(f"sampling_params.repetition_penalty={penalty}: kvrunner has none")
    if kwargs.get("top_k") == -1:  # verl's "off"
        kwargs["top_k"] = 0
    if params:
        raise RequestError(f"sampling_params: kvrunner does not take {sorted(params)}")
    return SamplingParams(**kwargs, return_routed_experts=routed_experts)


def token_output(out: RequestOutput, *, global_steps: int | None) -> Any:
    """verl's ``TokenOutput``: stop reason ``"aborted"`` for an abort (the tokens it
    had are kept: a partial rollout), ``"completed"`` for a stop or the length limit;
    ``routed_experts`` the output's ``[prompt + output - 1, layers, top_k]`` int32
    array where it asked for one (as verl's vLLM server hands vLLM's on)."""
    from verl.workers.rollout.replica import TokenOutput

    reason = {"abort": "aborted", "stop": "completed", "length": "completed"}.get(
        out.finish_reason or "", out.finish_reason)
    return TokenOutput(token_ids=list(out.token_ids),
                       log_probs=list(out.logprobs) if out.logprobs is not None else None,
                       stop_reason=reason,
                       routed_experts=out.routed_experts,
                       extra_fields={"global_steps": global_steps,
                                     "weight_versions": list(out.weight_versions)})
