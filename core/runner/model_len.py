"""The longest sequence the engine serves (``max_model_len``), and why.

Set in the config, it is used as given (never above the model's
``max_position_embeddings``: ``check_model_len`` refuses that). Unset, it is the
model's ``max_position_embeddings``, capped by what the KV pool holds: the ranks
build their buffers and backends for the model's bound, size the pool (the group's
minimum, so every rank agrees), and only then know the cap. The driver takes the
value the ranks report, as it takes ``max_num_batched_tokens``.
"""

from __future__ import annotations

import math

import attrs

#: the smallest max_model_len the config accepts (one prompt token, one output token)
MIN_MODEL_LEN = 2


@attrs.frozen(kw_only=True)
class ModelLen:
    """A resolved ``max_model_len`` and where it came from (for the start-up line)."""

    value: int
    #: "config", "model" (max_position_embeddings) or "pool" (capped by the KV pool)
    source: str
    reason: str

    def line(self) -> str:
        """The start-up line that says what was chosen and why."""
        return f"kvrunner: max_model_len={self.value} ({self.reason})"


def model_len_bound(asked: int | None, max_position_embeddings: int) -> int:
    """The length the runner's buffers and backends are built for, before sizing."""
    return max_position_embeddings if asked is None else asked


def min_pool_blocks(asked: int | None, block_size: int) -> int:
    """Blocks the pool needs at least: one whole ``max_model_len`` sequence when it is
    set; when unset, room for the shortest length the config accepts (the pool then
    caps the length instead of failing)."""
    return math.ceil((MIN_MODEL_LEN if asked is None else asked) / block_size)


def fit_model_len(
    asked: int | None, max_position_embeddings: int, *, num_blocks: int, block_size: int
) -> ModelLen:
    """``max_model_len`` for a pool of ``num_blocks`` blocks of ``block_size`` tokens."""
    if asked is not None:
        return ModelLen(value=asked, source="config", reason="set in the config")
    capacity = num_blocks * block_size
    if capacity >= max_position_embeddings:
        return ModelLen(
            value=max_position_embeddings, source="model",
            reason="the model's max_position_embeddings",
        )
    return ModelLen(
        value=capacity, source="pool",
        reason=f"the KV pool holds {capacity} tokens ({num_blocks} blocks of {block_size}), "
        f"fewer than the model's max_position_embeddings={max_position_embeddings}; "
        f"raise gpu_memory_utilization / cpu_cache_bytes / num_blocks for more",
    )


def agreed_model_len(descriptions: list[dict]) -> ModelLen:
    """The one ``max_model_len`` every rank resolved; raises if they differ."""
    from kvrunner.config import ConfigError

    lens = {(d["max_model_len"], d["max_model_len_source"], d["max_model_len_reason"])
            for d in descriptions}
    if len(lens) != 1:
        raise ConfigError(
            f"ranks resolved different max_model_len {sorted(v for v, _, _ in lens)}; "
            f"set max_model_len explicitly"
        )
    value, source, reason = lens.pop()
    return ModelLen(value=value, source=source, reason=reason)
