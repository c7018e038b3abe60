"""The policy: a small transformers Qwen3 model, saved as the engine's starting
checkpoint and loaded by the trainer, so both begin from the same weights."""

from __future__ import annotations

from pathlib import Path

import torch

#: model shapes by name: ``tiny`` learns on the CPU in minutes, ``large`` is for a GPU
SHAPES: dict[str, dict[str, int]] = {
    "tiny": dict(vocab_size=32, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=16),
    "large": dict(vocab_size=4096, hidden_size=1024, intermediate_size=3072,
                  num_hidden_layers=8, num_attention_heads=16, num_key_value_heads=8,
                  head_dim=64),
}

#: Adam's learning rate for each shape unless --lr says otherwise: the large shape at the
#: tiny's 3e-3 collapsed to one completion a prompt within 20 steps (every sample of a
#: group then scores alike, so GRPO's advantages are zero and learning stops)
LEARNING_RATES: dict[str, float] = {"tiny": 3e-3, "large": 1e-4}


def write_policy(path: Path, shape: str, seed: int) -> Path:
    """Save a randomly initialised Qwen3 policy of ``shape`` (seeded) to ``path``
    in Hugging Face format (untied head, float32) and return ``path``."""
    import transformers

    if shape not in SHAPES:
        raise ValueError(f"shape must be one of {sorted(SHAPES)}, got {shape!r}")
    torch.manual_seed(seed)
    config = transformers.Qwen3Config(**SHAPES[shape], max_position_embeddings=256,
                                      tie_word_embeddings=False, rope_theta=10000.0,
                                      eos_token_id=0, bos_token_id=0, pad_token_id=0)
    transformers.Qwen3ForCausalLM(config).save_pretrained(path, safe_serialization=True)
    return path
