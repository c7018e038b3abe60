"""What the driver knows about the model and the group without holding the weights."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import attrs
from tokenizers import Tokenizer

from kvrunner.config import ConfigError, EngineConfig
from kvrunner.models.generation_config import sampling_defaults


@attrs.frozen(kw_only=True)
class ModelInfo:
    """What the driver knows about the model: enough for the engine and the API."""

    path: Path
    #: None when the checkpoint has no tokenizer (or skip_tokenizer_init): token ids only
    tokenizer: Tokenizer | None
    eos_token_ids: tuple[int, ...]
    vocab_size: int
    layer_types: tuple[str, ...]
    #: SamplingParams fields the checkpoint's generation_config.json sets
    sampling_defaults: dict[str, Any] = attrs.field(factory=dict)

    @property
    def uses_state_slots(self) -> bool:
        return "linear_attention" in self.layer_types

    @classmethod
    def from_runner(cls, runner: Any) -> ModelInfo:
        return cls(
            path=runner.model_path,
            tokenizer=runner.tokenizer,
            eos_token_ids=tuple(runner.model_config.eos_token_id),
            vocab_size=runner.model_config.vocab_size,
            layer_types=tuple(runner.spec.layer_types),
            sampling_defaults=sampling_defaults(runner.model_path),
        )

    @classmethod
    def from_checkpoint(cls, config: EngineConfig) -> ModelInfo:
        """Read config and tokenizer only; also checks the model splits over the group."""
        from kvrunner.models.checkpoint_files import load_tokenizer
        from kvrunner.models.loader import (
            check_model_len,
            load_hf_config,
            model_spec,
            parse_config,
        )
        from kvrunner.runner.setup import resolve_model_path

        path = resolve_model_path(config.model)
        raw = load_hf_config(path)
        spec = model_spec(raw, tp_size=config.parallel.tensor_parallel_size)  # raises if not
        check_model_len(config.scheduler.max_model_len, raw)
        parsed = parse_config(raw)[1]
        return cls(
            path=path,
            tokenizer=load_tokenizer(path, skip=config.skip_tokenizer_init),
            eos_token_ids=tuple(parsed.eos_token_id),
            vocab_size=parsed.vocab_size,
            layer_types=tuple(spec.layer_types),
            sampling_defaults=sampling_defaults(path),
        )



def agreed_num_blocks(descriptions: list[dict[str, Any]]) -> int:
    """The one pool size every rank reported; raises if they differ."""
    counts = [d["num_blocks"] for d in descriptions]
    if len(set(counts)) != 1:
        raise RuntimeError(f"ranks allocated different pool sizes {counts}; they must agree")
    return counts[0]


def agreed_batched_tokens(descriptions: list[dict[str, Any]]) -> int:
    """The one step budget every rank resolved; raises if they differ (ranks on GPUs
    of different sizes resolve different defaults: the message says what to set)."""
    budgets = [d["max_num_batched_tokens"] for d in descriptions]
    if len(set(budgets)) != 1:
        raise ConfigError(
            f"ranks resolved different max_num_batched_tokens {budgets} (the default "
            f"follows each GPU's memory); set max_num_batched_tokens explicitly"
        )
    return budgets[0]
