"""What ``LLM.generate`` returns: one :class:`RequestOutput` per sample of a request."""

from __future__ import annotations

import attrs
import numpy as np


@attrs.frozen(kw_only=True)
class RequestOutput:
    """One sample's result.

    A request with ``SamplingParams(n=k)`` gives ``k`` outputs, one per sample, each
    with its ``sample_index`` (0 for a request of one sample).
    """

    #: the engine's request number (``LLM.generate``); through ``AsyncLLM``, the
    #: caller's id or a generated one
    request_id: int | str
    prompt: str | None
    prompt_token_ids: list[int]
    token_ids: list[int]
    #: the decoded output; "" when the model has no tokenizer (token ids only)
    text: str
    #: logprob of each generated token, when SamplingParams.logprobs was set
    logprobs: list[float] | None
    #: the top-N logprobs at each step, when SamplingParams.logprobs = N > 0
    top_logprobs: list[dict[int, float]] | None
    finish_reason: str | None
    #: each prompt token's logprob given the tokens before it (None for the first),
    #: when SamplingParams.prompt_logprobs was set
    prompt_logprobs: list[float | None] | None = None
    #: the top-N logprobs at each prompt position (None for the first), when
    #: SamplingParams.prompt_logprobs = N > 0
    prompt_top_logprobs: list[dict[int, float] | None] | None = None
    #: each prompt token's rank among its position's logprobs (1: the likeliest; None
    #: for the first), when SamplingParams.prompt_logprobs was set
    prompt_ranks: list[int | None] | None = None
    #: why it ended with finish reason "error": the engine step, the output position and
    #: the cause (``"step 12 (output token 3): logits hold NaN"``); else None
    error: str | None = None
    #: which of its request's ``n`` samples this is (``0 <= sample_index < n``)
    sample_index: int = 0
    #: what ended it with finish reason "stop": the matched stop string, or the stop
    #: token id (EOS included); None for any other finish
    stop_reason: int | str | None = None
    #: each generated token's kept mass: the probability, at the request's
    #: temperature, of the tokens min_p / top-k / top-p kept when it was drawn (1 for
    #: greedy and untruncated rows), when SamplingParams.return_kept_mass was set
    #: (layers/logprobs_mode.py)
    kept_mass: list[float] | None = None
    #: the weight version the last token was made under (``LLM.weight_version``: 0
    #: from start-up, then what each update named)
    weight_version: str | int | None = None
    #: ``(version, first output index)`` spans, in order: the tokens from each index up
    #: to the next span's were made under that version (more than one span only when
    #: the request was parked across a weight update)
    weight_versions: tuple[tuple[str | int, int], ...] = ()
    #: the experts each mixture-of-experts layer routed every computed token to, when
    #: SamplingParams.return_routed_experts was set: ``[prompt + output - 1,
    #: num_hidden_layers, top_k]`` int32, as vLLM's ``CompletionOutput.routed_experts``
    #: (row ``p`` is the token at position ``p``; the last output token is never fed
    #: back, so it has none); a dense layer's entries are -1
    routed_experts: np.ndarray | None = attrs.field(default=None, eq=False)
    #: prompt tokens whose KV came from the prefix cache rather than being computed
    #: (vLLM's ``num_cached_tokens``; SGLang's ``cached_tokens``)
    num_cached_tokens: int = 0
