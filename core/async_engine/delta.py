"""What ``AsyncLLM.generate_stream`` yields: the tokens one request gained since the
last delta."""

from __future__ import annotations

import attrs

from kvrunner.outputs import RequestOutput


@attrs.frozen(kw_only=True)
class StreamDelta:
    """The new part of one request's output.

    Joining every delta's ``token_ids`` (``logprobs``, ``top_logprobs``, ``kept_mass``,
    ``text``) gives the final output's. The last delta has a ``finish_reason`` and carries the
    whole :class:`~kvrunner.llm.RequestOutput` as ``output``; every earlier one has
    neither.
    """

    request_id: str
    token_ids: list[int]
    #: the new tokens' logprobs, when ``SamplingParams.logprobs`` was set
    logprobs: list[float] | None
    top_logprobs: list[dict[int, float]] | None
    #: the decoded text the new tokens added ("" without a tokenizer, and while the
    #: last tokens end inside a multi-byte character)
    text: str
    finish_reason: str | None = None
    output: RequestOutput | None = None
    #: the weight version the delta's last token was made under (for a delta without a
    #: new token, the output's last token's; for an output without any, its first one's)
    weight_version: str | int | None = None
    #: the prompt's logprobs (``SamplingParams.prompt_logprobs``; None for its first
    #: token), on the request's first delta only: the prefill that scored them is done
    #: by the time the first token is sampled
    prompt_logprobs: list[float | None] | None = None
    #: the top-N logprobs at each prompt position, on the first delta, when
    #: ``SamplingParams.prompt_logprobs`` = N > 0
    prompt_top_logprobs: list[dict[int, float] | None] | None = None
    #: each prompt token's rank at its position, on the first delta (None for the first)
    prompt_ranks: list[int | None] | None = None
    #: the new tokens' kept masses, when ``SamplingParams.return_kept_mass`` was set
    kept_mass: list[float] | None = None
