"""The bodies of the SGLang-shaped RL routes, with SGLang's field names.

A slime- or AReaL-style client sends these unchanged. Fields SGLang has that kvrunner
does not implement are accepted at their neutral value only (a grammar, a penalty, a
minimum length); anything unknown is a 400 naming it.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field

from kvrunner.serve.openai_protocol import NonNegativeInt, PositiveInt, StrictModel, TokenIds


class SGLangSamplingParams(StrictModel):
    """``sampling_params`` of ``/generate``."""

    #: 0 scores the prompt only (no output token; see ``logprob_start_len``)
    max_new_tokens: NonNegativeInt | None = 128
    min_new_tokens: NonNegativeInt = 0
    temperature: Annotated[float, Field(ge=0.0)] = 1.0
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] = 1.0
    #: -1 or 0 is off
    top_k: Annotated[int, Field(ge=-1)] = -1
    min_p: float = 0.0
    stop: str | list[str] | None = None
    stop_token_ids: list[NonNegativeInt] | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    no_stop_trim: bool = False
    n: PositiveInt = 1
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    sampling_seed: Annotated[int, Field(ge=0, lt=2**63)] | None = None
    regex: str | None = None
    json_schema: str | None = None
    ebnf: str | None = None
    logit_bias: dict[str, float] | None = None


class GenerateRequest(StrictModel):
    """``POST /generate``: exactly one of ``text`` and ``input_ids``."""

    text: str | None = None
    input_ids: TokenIds | None = None
    sampling_params: SGLangSamplingParams = Field(default_factory=SGLangSamplingParams)
    #: output (and, from ``logprob_start_len``, prompt) logprobs in ``meta_info``
    return_logprob: bool = False
    #: with ``return_logprob``: the prompt position ``input_token_logprobs`` start at
    #: (its first entry's logprob is null); -1 is SGLang's default, the last prompt
    #: token (none at all when ``max_new_tokens`` is 0); null is -1, as in SGLang
    logprob_start_len: Annotated[int, Field(ge=-1)] | None = -1
    #: the top-N logprobs at every returned position (prompt and output)
    top_logprobs_num: NonNegativeInt = 0
    #: each logprob triple's third item is the token's text (else null)
    return_text_in_logprobs: bool = False
    rid: str | None = None
    stream: bool = False


class AbortRequest(StrictModel):
    """``POST /abort_request``: one request by ``rid``, or every one."""

    rid: str = ""
    abort_all: bool = False


class PauseGenerationRequest(StrictModel):
    """``POST /pause_generation``. ``in_place`` and ``retract`` both keep the requests
    (with their KV) parked until ``/continue_generation``; ``abort`` ends them."""

    mode: Literal["abort", "retract", "in_place"] = "abort"


class ContinueGenerationRequest(StrictModel):
    """``POST /continue_generation``; ``torch_empty_cache`` is accepted and has no effect."""

    torch_empty_cache: bool = True


class MemoryOccupationRequest(StrictModel):
    """``/release_memory_occupation`` and ``/resume_memory_occupation``: which parts.
    SGLang's ``cuda_graph`` tag is kvrunner's ``kv_cache`` (graphs go with the pool)."""

    tags: list[Literal["weights", "kv_cache", "cuda_graph"]] | None = None


class UpdateWeightsFromDiskRequest(StrictModel):
    """``POST /update_weights_from_disk``."""

    model_path: Annotated[str, Field(min_length=1)]
    load_format: str | None = None
    abort_all_requests: bool = False
    weight_version: str | None = None
    is_async: bool = False
    torch_empty_cache: bool = False
    keep_pause: bool = False
    recapture_cuda_graph: bool = False
    token_step: int = 0
    flush_cache: bool = True
