"""Build a real BackendManager around a small model shape, for backend tests."""

from __future__ import annotations

from collections.abc import Mapping

import torch

from kvrunner.plugin_api.overlap import OverlapContext
from kvrunner.plugin_api.step_data import BackendContext, ModelSpec
from kvrunner.plugin_host.backend_manager import BackendManager


def small_model_spec(
    layer_types: tuple[str, ...] = ("full_attention", "full_attention"),
) -> ModelSpec:
    """Attention 4 q / 2 kv heads of 16; GDN 2 key / 4 value heads of 8, conv kernel 4."""
    return ModelSpec(
        num_layers=len(layer_types),
        layer_types=layer_types,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=8,
        linear_value_head_dim=8,
        linear_conv_kernel_dim=4,
    )


def backend_manager(
    selection: Mapping[str, str],
    spec: ModelSpec,
    *,
    block_size: int = 4,
    max_num_seqs: int = 4,
    max_num_batched_tokens: int = 64,
    max_model_len: int = 64,
    dtype: torch.dtype = torch.float32,
    device: str = "cpu",
    use_triton: bool = False,
    overlap: str | None = None,
    kv_cache_dtype: str = "auto",
) -> BackendManager:
    """A manager with the selected backends registered, as a runner would build it;
    with ``overlap``, that overlap plugin on top, splitting every step it can;
    ``kv_cache_dtype`` reaches every backend's context."""

    def context_for(name: str, layer_types: tuple[str, ...]) -> BackendContext:
        return BackendContext(
            name=name,
            layers=tuple(i for i, t in enumerate(spec.layer_types) if t in layer_types),
            model=spec,
            dtype=dtype,
            device=torch.device(device),
            block_size=block_size,
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            max_model_len=max_model_len,
            use_triton=use_triton,
            kv_cache_dtype=kv_cache_dtype,
        )

    overlap_context = None if overlap is None else OverlapContext(
        name=overlap, device=torch.device(device), max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens, tensor_parallel_size=1,
        min_tokens=2, min_decode_seqs=2,
    )
    return BackendManager(selection, context_for, overlap=overlap_context)
