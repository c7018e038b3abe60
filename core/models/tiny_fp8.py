"""Tiny checkpoints for the FP8 path: a dense Qwen3 whose projections split on 128 x 128
block boundaries and its Qwen3-MoE sibling, their FP8 form (as Qwen's FP8 checkpoints
store it), and the FP8 form dequantized back to float32 (the CPU oracle: an engine on
those weights computes exactly what the FP8 engine computes there).

The FP8 form keeps every tensor but the projections as it is, stores each projection
``*.{q,k,v,o,gate,up,down}_proj.weight`` (each expert's too:
``mlp.experts.{e}.gate_proj.weight``) as ``float8_e4m3fn`` beside its
``weight_scale_inv``, and adds ``quantization_config`` to ``config.json``; a router
(``mlp.gate.weight``) stays as it is, as in Qwen's FP8 MoE checkpoints.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from kvrunner.layers.fp8.blocks import BLOCK, dequantize_blocks, quantize_blocks
from kvrunner.models.tiny_moe_weights import sparse_mlps
from kvrunner.models.tiny_weights import tiny_qwen3

#: the checkpoint names' projections an FP8 checkpoint stores quantized
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
#: ``config.json``'s ``quantization_config`` of Qwen's FP8 checkpoints
FP8_QUANTIZATION_CONFIG = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                           "weight_block_size": [BLOCK, BLOCK]}


def is_projection(name: str) -> bool:
    """Whether checkpoint tensor ``name`` is a projection weight an FP8 checkpoint quantizes."""
    return any(name.endswith(f".{p}.weight") for p in PROJECTIONS)


def tiny_qwen3_blocks(gen: torch.Generator, vocab: int, eos: int) -> tuple[dict, dict]:
    """Qwen3 dense with every projection part a multiple of 128: hidden 128, 2 layers,
    4 query / 2 KV heads of 64 (q 256, k and v 128 rows), MLP 384, untied head."""
    config, _ = tiny_qwen3(torch.Generator().manual_seed(0), vocab, eos)
    hidden, inter, heads, kv_heads, head_dim = 128, 384, 4, 2, 64
    config.update(hidden_size=hidden, intermediate_size=inter, num_attention_heads=heads,
                  num_key_value_heads=kv_heads, head_dim=head_dim)
    t: dict[str, torch.Tensor] = {"model.embed_tokens.weight": torch.randn(
        (vocab, hidden), generator=gen)}
    shapes = {"q_proj": (heads * head_dim, hidden), "k_proj": (kv_heads * head_dim, hidden),
              "v_proj": (kv_heads * head_dim, hidden), "o_proj": (hidden, heads * head_dim),
              "gate_proj": (inter, hidden), "up_proj": (inter, hidden),
              "down_proj": (hidden, inter)}
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        for norm, dim in (("input_layernorm", hidden), ("post_attention_layernorm", hidden),
                          ("self_attn.q_norm", head_dim), ("self_attn.k_norm", head_dim)):
            t[f"{p}{norm}.weight"] = 1.0 + torch.randn((dim,), generator=gen) * 0.1
        for proj, shape in shapes.items():
            where = "mlp" if proj in ("gate_proj", "up_proj", "down_proj") else "self_attn"
            t[f"{p}{where}.{proj}.weight"] = torch.randn(shape, generator=gen) * 0.08
    t["model.norm.weight"] = 1.0 + torch.randn((hidden,), generator=gen) * 0.1
    t["lm_head.weight"] = torch.randn((vocab, hidden), generator=gen) * 0.08
    return config, t


def tiny_qwen3_moe_blocks(gen: torch.Generator, vocab: int, eos: int) -> tuple[dict, dict]:
    """:func:`tiny_qwen3_blocks` with every MLP a sparse block: 4 experts of 256 (two
    blocks, so two tensor-parallel ranks split them on a block boundary), top-2,
    renormalised."""
    config, tensors = tiny_qwen3_blocks(gen, vocab, eos)
    config.update(architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe")
    sparse_mlps(gen, config, tensors, experts=4, top_k=2, shared=0, inter=2 * BLOCK)
    return config, tensors


def _copy_side_files(src: Path, dst: Path) -> dict:
    dst.mkdir(parents=True, exist_ok=True)
    for file in src.iterdir():
        if file.suffix != ".safetensors" and file.name != "model.safetensors.index.json":
            shutil.copy(file, dst / file.name)
    return json.loads((src / "config.json").read_text())


def write_fp8_checkpoint(src: str | Path, dst: str | Path) -> Path:
    """Write ``src`` (a one-file float checkpoint) into ``dst`` in FP8 form (see the
    module docstring); returns ``dst``."""
    src, dst = Path(src), Path(dst)
    config = _copy_side_files(src, dst)
    out: dict[str, torch.Tensor] = {}
    for name, tensor in load_file(str(src / "model.safetensors")).items():
        if is_projection(name):
            out[name], out[name + "_scale_inv"] = quantize_blocks(tensor)
        else:
            out[name] = tensor
    save_file(out, str(dst / "model.safetensors"), metadata={"format": "pt"})
    config["quantization_config"] = dict(FP8_QUANTIZATION_CONFIG)
    (dst / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    return dst


def write_dequantized_checkpoint(src: str | Path, dst: str | Path,
                                 dtype: torch.dtype = torch.float32) -> Path:
    """Write the FP8 checkpoint ``src`` into ``dst`` with every projection dequantized
    to ``dtype`` and no ``quantization_config``; returns ``dst``."""
    src, dst = Path(src), Path(dst)
    config = _copy_side_files(src, dst)
    tensors = load_file(str(src / "model.safetensors"))
    out = {name: dequantize_blocks(t, tensors[name + "_scale_inv"], dtype)
           if is_projection(name) else t
           for name, t in tensors.items() if not name.endswith("_scale_inv")}
    save_file(out, str(dst / "model.safetensors"), metadata={"format": "pt"})
    config.pop("quantization_config", None)
    (dst / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    return dst
