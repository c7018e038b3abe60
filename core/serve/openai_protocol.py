"""The bodies of the OpenAI-compatible routes, as pydantic models.

Strict on purpose: an unknown field, a string where a number belongs, a float
``max_tokens`` or a bool ``n`` is a 400 naming the field, not a silent coercion. The
fields are OpenAI's (``response_format`` included), plus the vLLM extras RL clients
send (TRL's ``VLLMClient``, verifiers, prime-rl, SkyRL), ``structured_outputs`` and its
older ``guided_*`` spellings among them: ``top_k``, ``ignore_eos``, ``stop_token_ids``,
``return_tokens_as_token_ids``, ``return_token_ids``, ``prompt_logprobs``,
``truncate_prompt_tokens``, ``chat_template_kwargs`` and the rest below. ``echo``
(without ``stream``) puts the prompt in front of the text and, with ``logprobs``, its
logprobs in front of the completion's. A documented field asking for what kvrunner
does not do is accepted at its neutral value only, and otherwise a 400 naming it
(:data:`kvrunner.serve.request_params.VLLM_NEUTRAL`).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

#: an int that JSON may not give as 2.0, "2" or true
PositiveInt = Annotated[int, Field(ge=1)]
NonNegativeInt = Annotated[int, Field(ge=0)]
TokenIds = Annotated[list[NonNegativeInt], Field(min_length=1)]


class StrictModel(BaseModel):
    """Unknown fields and type coercions are refused."""

    model_config = ConfigDict(extra="forbid", strict=True)


class StreamOptions(StrictModel):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class ResponseFormat(BaseModel):
    """OpenAI's ``response_format``; a ``json_schema`` one holds ``json_schema`` with
    ``name``, ``schema`` and ``strict``, a ``structural_tag`` one xgrammar's tag fields."""

    model_config = ConfigDict(extra="allow")
    type: Literal["text", "json_object", "json_schema", "structural_tag"]


class SamplingFields(StrictModel):
    """What completions and chat completions share."""

    model: str
    n: PositiveInt = 1
    temperature: Annotated[float, Field(ge=0.0)] = 1.0
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] = 1.0
    #: vLLM's extra: 0 or -1 is off
    top_k: Annotated[int, Field(ge=-1)] = 0
    seed: Annotated[int, Field(ge=0, lt=2**63)] | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[NonNegativeInt] | None = None
    ignore_eos: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    #: OpenAI's: key-value tags for the caller's own records; no effect on generation
    metadata: dict[str, str] | None = None
    # vLLM's sampling extras (neutral values only: see request_params.VLLM_NEUTRAL)
    repetition_penalty: float = 1.0
    min_p: float = 0.0
    min_tokens: NonNegativeInt = 0
    allowed_token_ids: list[NonNegativeInt] | None = None
    bad_words: list[str] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    #: vLLM's constraint on the output: ``json``, ``regex``, ``choice``, ``grammar``,
    #: ``json_object`` or ``structural_tag`` (``serve/structured_fields.py``)
    structured_outputs: dict[str, Any] | None = None
    #: OpenAI's: ``text`` (no constraint), ``json_object``, ``json_schema``; and vLLM's
    #: ``structural_tag``
    response_format: ResponseFormat | None = None
    #: vLLM's older spellings of one ``structured_outputs`` field each
    guided_json: str | dict[str, Any] | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    #: vLLM's: keep only the last k prompt tokens (-1: as many as the model's length
    #: leaves room for)
    truncate_prompt_tokens: Annotated[int, Field(ge=-1)] | None = None
    #: vLLM's: ``prompt_token_ids`` and each choice's ``token_ids`` in the answer
    return_token_ids: bool = False
    #: vLLM's: each prompt token's logprob and the top-N there (``prompt_logprobs`` of
    #: the choice, in vLLM's shape)
    prompt_logprobs: NonNegativeInt | None = None
    #: vLLM's request id (the answer's ``id`` keeps kvrunner's)
    request_id: str | None = None
    #: vLLM's scheduling priority: 0 only (kvrunner schedules first come, first served)
    priority: int = 0
    #: kvrunner's: each choice's ``kept_mass``, one per output token
    #: (``SamplingParams.return_kept_mass``)
    return_kept_mass: bool = False
    #: vLLM's prefix-cache namespace: only requests with the same salt share cached KV
    cache_salt: Annotated[str, Field(min_length=1)] | None = None
    #: each choice's ``routed_experts`` (vLLM's ``.npy`` in base64,
    #: serve/routed_experts.py): null follows the server (every choice, on a server
    #: started with ``--enable-return-routed-experts``, as vLLM), true asks (a 400 on a
    #: server that records none), false leaves them out
    return_routed_experts: bool | None = None
    #: vLLM's: ``routed_experts`` leaves out the rows of the prompt's first N tokens
    routed_experts_prompt_start: NonNegativeInt = 0


class CompletionRequest(SamplingFields):
    """``POST /v1/completions``: text or token-id prompts, one or a batch."""

    prompt: str | TokenIds | list[str] | list[TokenIds]
    #: None: up to the model's length
    max_tokens: PositiveInt | None = 16
    logprobs: NonNegativeInt | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: PositiveInt | None = None
    #: vLLM's extra: name each logprob's token ``token_id:<id>`` instead of its text
    return_tokens_as_token_ids: bool = False


class TextPart(StrictModel):
    type: Literal["text"]
    text: str


class MediaPart(BaseModel):
    """An image, audio or video part: refused by name (kvrunner serves text models)."""

    model_config = ConfigDict(extra="allow")
    type: Literal["image_url", "input_audio", "audio_url", "video_url", "image", "file"]


class FunctionCall(StrictModel):
    name: str
    #: the call's arguments as a JSON text, as OpenAI writes them
    arguments: str


class ToolCall(StrictModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(StrictModel):
    role: Literal["system", "user", "assistant", "developer", "tool"]
    #: null for an assistant turn that only calls tools
    content: str | list[TextPart | MediaPart] | None = None
    name: str | None = None
    #: an assistant turn's tool calls
    tool_calls: list[ToolCall] | None = None
    #: a tool turn: the call it answers
    tool_call_id: str | None = None
    #: an assistant turn's reasoning, for templates that render it (Qwen3's)
    reasoning_content: str | None = None


class FunctionDefinition(StrictModel):
    """A tool's function, as the template renders it: other keys a client's schema
    writer adds (transformers' ``get_json_schema`` adds ``return``) are kept for it."""

    model_config = ConfigDict(extra="allow", strict=True)
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(StrictModel):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class NamedFunction(StrictModel):
    name: Annotated[str, Field(min_length=1)]


class NamedToolChoice(StrictModel):
    """A ``tool_choice`` naming the one function the answer calls."""

    type: Literal["function"] = "function"
    function: NamedFunction


class ChatCompletionRequest(SamplingFields):
    """``POST /v1/chat/completions``: messages rendered with the checkpoint's chat template."""

    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_tokens: PositiveInt | None = None
    max_completion_tokens: PositiveInt | None = None
    logprobs: bool = False
    top_logprobs: NonNegativeInt | None = None
    #: vLLM's extra: end the rendered prompt with the assistant's turn opening
    add_generation_prompt: bool = True
    return_tokens_as_token_ids: bool = False
    #: rendered into the prompt by the chat template (``tools`` in the template)
    tools: list[Tool] | None = None
    #: "none": the tools are rendered and the caller parses any call from the text;
    #: "auto": the server's tool-call parser reads the calls (serve/chat_parsing.py);
    #: "required" or a named function: the output is held to the tools' schema
    #: (serve/tool_choice.py)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    #: extra variables for the chat template (Qwen3's ``enable_thinking``)
    chat_template_kwargs: dict[str, Any] | None = None
    #: a template for this request instead of the checkpoint's (compiled sandboxed)
    chat_template: str | None = None
    #: vLLM's: continue the last (assistant) message instead of opening a new turn
    continue_final_message: bool = False
    #: vLLM's: let the tokenizer add its special tokens around the rendered text
    add_special_tokens: bool = False
