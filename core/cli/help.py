"""Help text for the command line's config flags, one line per config field.

The flags are generated from the config classes (``--block-size`` for
``[cache] block_size``); this module says what each one does. The flag's default
and its choices are appended from the config class itself, so they cannot drift.
"""

from __future__ import annotations

from typing import Any

import attrs

#: config field -> what it does (a test checks every field has an entry)
FIELD_HELP: dict[str, str] = {
    # top level
    "model": "HF-format checkpoint directory, or an embedded default (tiny-qwen3, "
    "tiny-qwen3-next, tiny-qwen3-moe, tiny-qwen3-next-moe: random weights)",
    "dtype": "weight and activation dtype; auto is float32 on the CPU, the checkpoint's "
    "half type (else bfloat16) on CUDA",
    "device": "auto (CUDA if available, else CPU), cpu, cuda or cuda:N",
    "seed": "seed of the sampler for requests without their own seed",
    "load_format": "auto reads the checkpoint's weights; dummy starts from config.json "
    "alone with small random weights (a trainer pushes the real ones)",
    "check_finite": "refuse a checkpoint tensor holding NaN or inf at start-up, naming it "
    "(one pass over each tensor as it is read)",
    "skip_tokenizer_init": "load no tokenizer even if the checkpoint has one "
    "(prompts must be token ids)",
    "generation_config": "auto: a call without sampling settings uses the checkpoint's"
    " generation_config.json (temperature, top_p, top_k, max_new_tokens); ignore: not",
    "deterministic": "batch-invariant kernels: a request's tokens and logprobs do not "
    "depend on what else shares its steps (slower; refused where a backend cannot)",
    "fp32_lm_head": "compute the LM head's product in float32 (the logits see no bf16 "
    "rounding; SGLang's --enable-fp32-lm-head)",
    "fp32_router_logits": "compute MoE router logits in float32 (near-tie experts chosen "
    "as a float32 trainer chooses them)",
    "logprobs_mode": "what returned logprobs are: raw_logprobs (the model's), raw_logits, "
    "processed_logprobs or processed_logits (after penalties, temperature, min_p, top-k "
    "and top-p, renormalised over the kept tokens), as vLLM's --logprobs-mode",
    "enable_return_routed_experts": "record each token's routed experts per KV slot, so "
    "requests may ask for them (return_routed_experts; mixture-of-experts models only)",
    "quantization": "fp8: the projections' and MoE experts' weights in FP8 e4m3 with "
    "128x128 block scales (bf16 checkpoints and pushes quantized as they load); auto: as "
    "the checkpoint's "
    "quantization_config says; none: the model dtype",
    # [cache]
    "block_size": "tokens per KV-cache block",
    "gpu_memory_utilization": "fraction of the GPU's memory the engine may use "
    "(weights, activations and cache)",
    "cpu_cache_bytes": "bytes for all cache pools on the CPU",
    "num_blocks": "fixed number of KV blocks (skips sizing; 'none' to size)",
    "enable_prefix_caching": "reuse KV blocks of prompts that share a prefix",
    "kv_cache_dtype": "how full-attention keys and values are stored: auto (the model's "
    "dtype) or fp8 (float8 e4m3, one byte an element, scaled per layer: the checkpoint's "
    "k_scale/v_scale, else 1.0 or calculate_kv_scales; fp8_e4m3 is the same)",
    "calculate_kv_scales": "with kv_cache_dtype fp8: set each layer's key and value scales "
    "from its first prefill (amax/200, amax/100, as vLLM) unless the checkpoint brings them",
    "salt_prefix_cache_by_weight_version": "share cached KV only among requests admitted "
    "under the same weight version (also where an update keeps the prefix cache)",
    # [scheduler]
    "max_num_seqs": "most sequences in one step (and most decode graphs' batch size)",
    "max_num_batched_tokens": "most tokens in one step (unset: 16384 on a GPU of "
    "70 GiB or more, 8192 on a smaller one, 2048 on the CPU)",
    "max_model_len": "most tokens per sequence, prompt and output together "
    "(at most the model's max_position_embeddings; unset: that, capped by what the "
    "KV pool holds)",
    "enable_chunked_prefill": "split long prompts over several steps",
    "async_scheduling": "schedule the next step while this one runs; sampled tokens "
    "feed the next step on the device (same tokens as off)",
    "nonfinite": "a request whose logits row is NaN/inf ends with finish reason "
    "error; raise also makes that call raise NonFiniteLogitsError",
    "max_logprobs": "the most top logprobs a request may ask for (SamplingParams.logprobs)",
    # [parallel]
    "tensor_parallel_size": "ranks to split the model over (one process each)",
    "distributed_backend": "torch.distributed backend; auto is NCCL on CUDA, gloo on the CPU",
    "distributed_timeout_s": "seconds a collective or a step may take before it fails",
    "startup_timeout_s": "seconds the ranks may take to load, size and capture",
    "heartbeat_timeout_s": "seconds a rank may go without a heartbeat before it is named",
    "distributed_executor": "mp spawns the ranks; torchrun means they were launched "
    "by torchrun (kvrunner.launch)",
    "all_reduce": "decode all-reduces through symmetric memory where possible (auto), "
    "never (nccl), or always (symm_mem)",
    # [capture]
    "enforce_eager": "run every step eagerly: no decode graphs",
    "capture_sizes": "comma-separated decode batch sizes to capture, each at most "
    "max_num_seqs (default 1,2,4,8, then every 16 up to max_num_seqs)",
    "audit": "check every capture writes no pool byte and every step only its own slots",
    "blank_write_targets": "blank backends' cache-write buffers before capture",
    "decode_graph_ends_at": "where a decode graph ends: tokens (sampling captured too), "
    "logits, or hidden (the forward alone)",
    # [backends]
    "full_attention": "backend serving full-attention layers (see `kvrunner backends`)",
    "linear_attention": "backend serving linear-attention layers (see `kvrunner backends`)",
    "overlap": "overlap plugin on top of the layer backends: none or tbo (two-batch overlap)",
    "overlap_min_tokens": "prefill/mixed steps with fewer tokens are not split by the overlap",
    "overlap_min_decode_seqs": "decode steps/graphs with fewer sequences are not split",
    # [kernels]
    "triton_on_cpu": "run the Triton kernels on CPU tensors too (under TRITON_INTERPRET=1; "
    "for tests)",
    "fused_sampler": "draw seeded, unfiltered rows in one pass over their logits (Triton path)",
    "skinny_gemm": "decode projections through the skinny-GEMM kernel: auto (one row), "
    "on (up to 64 rows), off",
    "gdn_prefill": "gdn's chunked prefill: auto (fla where it serves, else ours), ours, "
    "or fla (an error where fla cannot run)",
}


def choices_of(field: attrs.Attribute) -> tuple[str, ...] | None:
    """The values a field's ``_one_of`` validator allows, if it has one."""
    return getattr(field.validator, "choices", None)


def field_help(field: attrs.Attribute, section: str | None) -> str:
    """A flag's help: what it does, where it lives in a TOML file, and its default."""
    where = f"[{section}] {field.name}" if section else field.name
    default: Any = field.default
    if isinstance(default, attrs.Factory):  # type: ignore[arg-type]
        default = default.factory()
    if isinstance(default, bool):
        shown = "on" if default else "off"
    elif default is None:
        shown = "none"
    else:
        shown = str(default)
    return f"{FIELD_HELP.get(field.name, field.name)} (TOML: {where}; default: {shown})"
