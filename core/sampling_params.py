"""Per-request sampling settings, shaped like vLLM's ``SamplingParams``."""

from __future__ import annotations

import attrs


def _positive(instance: object, attribute: attrs.Attribute, value: int) -> None:
    if value < 1:
        raise ValueError(f"SamplingParams.{attribute.name} must be >= 1, got {value}")


@attrs.frozen(kw_only=True)
class SamplingParams:
    """How to pick tokens for one request.

    ``temperature == 0`` is greedy. ``top_k <= 0`` and ``top_p == 1`` disable those
    filters. ``seed`` makes sampling reproducible per request whatever the batch.
    ``logprobs=None`` returns none; ``logprobs=N`` returns the sampled token's logprob
    and the N most likely tokens' logprobs at every step.
    """

    max_tokens: int = attrs.field(default=16, validator=_positive)
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    ignore_eos: bool = False
    stop_token_ids: tuple[int, ...] = attrs.field(default=(), converter=tuple)
    logprobs: int | None = None

    def __attrs_post_init__(self) -> None:
        if self.temperature < 0:
            raise ValueError(f"SamplingParams.temperature must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"SamplingParams.top_p must be in (0, 1], got {self.top_p}")
        if self.logprobs is not None and self.logprobs < 0:
            raise ValueError(f"SamplingParams.logprobs must be >= 0, got {self.logprobs}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0
