"""The bodies of the OpenAI-compatible routes, as pydantic models.

Strict on purpose: an unknown field, a string where a number belongs, a float
``max_tokens`` or a bool ``n`` is a 400 naming the field, not a silent coercion. The
fields are OpenAI's, plus the vLLM extras RL clients send (``top_k``, ``ignore_eos``,
``stop_token_ids``, ``return_tokens_as_token_ids``). ``echo`` (without ``stream``) puts the
prompt in front of the text and, with ``logprobs``, its logprobs in front of the
completion's. Fields OpenAI defines but kvrunner
does not implement (penalties, ``logit_bias``, ``suffix``, ``best_of``) are
accepted at their neutral value only; see :func:`kvrunner.serve.request_params.refuse_unsupported`.
"""

from __future__ import annotations

from typing import Annotated, Literal

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


class ChatMessage(StrictModel):
    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[TextPart]
    name: str | None = None


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
