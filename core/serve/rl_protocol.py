"""The bodies of the SGLang-shaped RL routes, with SGLang's field names.

A slime- or AReaL-style client sends these unchanged. ``sampling_params`` holds every
field of SGLang's ``SamplingParams`` with its default and range; a null is the field's
default, as SGLang takes it; ``json_schema``, ``regex``, ``ebnf`` and ``structural_tag``
constrain the output (``serve/structured_fields.py``). Fields SGLang has that kvrunner
does not implement are accepted at their neutral value only (a stop regex, custom logit-processor
parameters, empty multimodal inputs such as AReaL's ``image_data: []``, no LoRA);
anything unknown is a 400 naming it.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Discriminator, Field, Tag

from kvrunner.serve.openai_protocol import NonNegativeInt, PositiveInt, StrictModel, TokenIds


class SGLangSamplingParams(StrictModel):
    """``sampling_params`` of ``/generate``."""

    #: 0 scores the prompt only (no output token; see ``logprob_start_len``)
    max_new_tokens: NonNegativeInt | None = 128
    #: the stop token ids and EOS are masked until this many tokens were generated
    min_new_tokens: NonNegativeInt | None = None
    temperature: Annotated[float, Field(ge=0.0)] = 1.0
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] = 1.0
    #: -1 or 0 is off
    top_k: Annotated[int, Field(ge=-1)] = -1
    min_p: Annotated[float, Field(ge=0.0, le=1.0)] | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[NonNegativeInt] | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool | None = None
    spaces_between_special_tokens: bool | None = None
    #: keep a matched stop string in the text (``include_stop_str_in_output``)
    no_stop_trim: bool | None = None
    n: PositiveInt = 1
    frequency_penalty: Annotated[float, Field(ge=-2.0, le=2.0)] | None = None
    presence_penalty: Annotated[float, Field(ge=-2.0, le=2.0)] | None = None
    #: SGLang's range (0, 2]; it counts the output's tokens only, not the prompt's
    repetition_penalty: Annotated[float, Field(gt=0.0, le=2.0)] | None = None
    sampling_seed: Annotated[int, Field(ge=0, lt=2**63)] | None = None
    regex: str | None = None
    json_schema: str | None = None
    ebnf: str | None = None
    structural_tag: str | None = None
    stop_regex: str | list[str] | None = None
    #: token ids as text -> the bias added to their logits (not clamped, as in SGLang)
    logit_bias: dict[str, float] | None = None
    #: SGLang's per-request stream chunking: accepted unset only (kvrunner streams
    #: every step)
    stream_interval: PositiveInt | None = None
    custom_params: dict[str, Any] | None = None


#: a prefix-cache namespace: a non-empty string
ExtraKey = Annotated[str, Field(min_length=1)]


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
    #: kvrunner's: each output token's kept mass, ``meta_info.output_token_kept_mass``
    #: (``SamplingParams.return_kept_mass``)
    return_kept_mass: bool = False
    rid: str | None = None
    stream: bool = False
    #: SGLang's prefix-cache namespace (vLLM's ``cache_salt``): only requests with the
    #: same key share cached KV
    extra_key: ExtraKey | None = None
    # GenerateReqInput's other fields: accepted empty or off only (see generate_routes)
    image_data: Any = None
    video_data: Any = None
    audio_data: Any = None
    lora_path: Any = None
    lora_id: Any = None
    input_embeds: Any = None
    token_ids_logprob: Any = None
    return_hidden_states: bool = False
    #: ``meta_info.routed_experts``: each computed token's experts (SGLang's encoding)
    return_routed_experts: bool = False
    custom_logit_processor: Any = None
    bootstrap_host: Any = None
    bootstrap_port: Any = None
    bootstrap_room: Any = None
    data_parallel_rank: int | None = None
    #: SGLang's scheduling priority and log options: no effect here
    priority: int | None = None
    log_metrics: bool = True
    background: bool = False


def _one_or_list(value: object) -> str:
    return "list" if isinstance(value, list) else "dict"


#: a batch's sampling_params: one for every prompt, or one each (the union's members
#: are tagged "dict" and "list", which an error's field path leaves out)
BatchSamplingParams = Annotated[
    Annotated[SGLangSamplingParams, Tag("dict")]
    | Annotated[Annotated[list[SGLangSamplingParams], Field(min_length=1)], Tag("list")],
    Discriminator(_one_or_list),
]
StartLen = Annotated[int, Field(ge=-1)] | None


class BatchGenerateRequest(StrictModel):
    """``POST /generate`` with a list of prompts (SGLang's batch form): ``text`` a list
    of strings or ``input_ids`` a list of token-id lists. Each per-request field is one
    value for every prompt or a list of one per prompt; ``rid``, when given, is a list."""

    text: Annotated[list[str], Field(min_length=1)] | None = None
    input_ids: Annotated[list[TokenIds], Field(min_length=1)] | None = None
    sampling_params: BatchSamplingParams = Field(default_factory=SGLangSamplingParams)
    return_logprob: bool | list[bool] = False
    logprob_start_len: StartLen | list[StartLen] = -1
    top_logprobs_num: NonNegativeInt | list[NonNegativeInt] = 0
    return_text_in_logprobs: bool = False
    return_kept_mass: bool = False
    #: every prompt's routed experts in its answers' ``meta_info``
    return_routed_experts: bool = False
    rid: list[str] | None = None
    stream: bool = False
    extra_key: ExtraKey | list[ExtraKey] | None = None

    @staticmethod
    def is_batch(data: object) -> bool:
        """Whether a /generate JSON body gives a list of prompts."""
        if not isinstance(data, dict):
            return False
        text, ids = data.get("text"), data.get("input_ids")
        return isinstance(text, list) or (isinstance(ids, list) and bool(ids)
                                          and isinstance(ids[0], list))


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
