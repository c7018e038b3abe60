"""What the fleet tests serve and ask: engine settings, prompts, sampling, pushes."""

from __future__ import annotations

from pathlib import Path

from kvrunner import SamplingParams

#: small pools and no capture pass: start-up in seconds
SMALL = dict(enforce_eager=True, max_num_seqs=8, max_model_len=512, block_size=16,
             cpu_cache_bytes=4 << 20)
PROMPTS = [[3, 17, 29, 101], [7, 8, 9, 10, 11, 12, 13, 14, 15], [200, 201]]
GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
#: a sampled request with its own seed draws the same on any replica
SEEDED = SamplingParams(max_tokens=6, temperature=1.0, seed=11, ignore_eos=True)


def checkpoint_tensors(path: str) -> list:
    """The checkpoint's tensors as ``(HF name, tensor)`` pairs, as a trainer pushes them."""
    import torch

    from kvrunner.models.loader import iter_safetensors

    return list(iter_safetensors(Path(path), torch.float32))
