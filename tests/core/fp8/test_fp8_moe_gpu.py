"""FP8 experts on CUDA: the w8a16 kernels at Qwen3-30B-A3B's layer shape against the
dequantized reference, in a CUDA graph, and engines: a medium Qwen3-MoE's logprobs
and greedy tokens against bf16's, and a push and a sleep with graphs captured.

Bounds stated here:

* the layer: within a relative error (Frobenius) of 1e-2 of the float32 torch path on
  the dequantized weights, as the bf16 kernels are held to on bf16 weights
  (``tests/core/layers/test_moe_layer.py``'s GPU sibling): the w8a16 kernels multiply
  exactly the dequantized weights rounded to bf16, so only bf16 roundings remain;
* the engine, over 64 random prompts (``engine_kit.stays_within_rounding_of_bf16``):
  the mean |logprob - bf16's| per prompt token at most twice a bf16 engine's on the
  weights rounded to FP8 (w8a8 rounds the activations too, an independent loss of
  the same size: about sqrt(2) times), and the first greedy token bf16's on at least
  85% of the prompts, with at most twice the rounding's disagreements, plus one.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from kvrunner import LLM
from kvrunner.layers.fp8.blocks import BLOCK
from kvrunner.layers.fp8.choice import building_with
from kvrunner.layers.fp8.experts import dequantize_experts, quantize_experts
from kvrunner.layers.fused.moe_triton import fp8_tiles, grouped_experts_triton, kernel_config
from kvrunner.layers.moe import SparseMoeBlock
from kvrunner.layers.moe_align import align_to_blocks
from kvrunner.layers.moe_experts import grouped_experts_torch

from .engine_kit import pushes_and_sleep_serve_the_pushed_weights, stays_within_rounding_of_bf16

pytestmark = pytest.mark.gpu

EXPERTS, TOP_K, HIDDEN, INTER = 128, 8, 2048, 768


def fp8_block_30b(*, seed: int = 0) -> SparseMoeBlock:
    """The 30B-A3B layer with FP8 experts quantized from std 1/sqrt(fan-in) bf16 weights."""
    with building_with("fp8"):
        block = SparseMoeBlock(hidden_size=HIDDEN, num_experts=EXPERTS, top_k=TOP_K,
                               intermediate_size=INTER, renormalize=True, dtype=torch.bfloat16,
                               device="cuda")
    gen = torch.Generator(device="cuda").manual_seed(seed)

    def normal(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen, device="cuda") / shape[-1] ** 0.5).to(
            torch.bfloat16)

    e = block.experts
    q13, s13, q2, s2 = quantize_experts(normal(EXPERTS, 2 * INTER, HIDDEN),
                                        normal(EXPERTS, HIDDEN, INTER))
    with torch.no_grad():
        block.gate.weight.copy_(normal(EXPERTS, HIDDEN))
        for param, value in ((e.w13, q13), (e.w13_scale_inv, s13), (e.w2, q2),
                             (e.w2_scale_inv, s2)):
            param.copy_(value)
    return block


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.double() - ref.double()).norm() / ref.double().norm())


@pytest.mark.parametrize("tokens", [1, 7, 64, 256, 1024])
def test_w8a16_kernels_are_within_bf16_rounding_of_the_dequantized_reference(tokens: int) -> None:
    block = fp8_block_30b()
    e = block.experts
    x = torch.randn(tokens, HIDDEN, device="cuda", dtype=torch.bfloat16)
    weights, ids = block.route(x)
    out = e(x, weights, ids)
    w13, w2 = dequantize_experts(e.w13, e.w13_scale_inv, e.w2, e.w2_scale_inv, torch.float32)
    ref = grouped_experts_torch(x.float(), w13, w2, weights.float(), ids).sum(dim=1)
    assert out.dtype == torch.bfloat16 and out.shape == ref.shape
    assert rel_err(out, ref) < 1e-2
    # the unscaled kernels on the dequantized bf16 weights, same tiles: bf16 roundings apart
    config = fp8_tiles(kernel_config(ids.numel(), EXPERTS), BLOCK)
    blocks = align_to_blocks(ids, EXPERTS, config["BLOCK_M"])
    plain = grouped_experts_triton(x, w13.to(torch.bfloat16), w2.to(torch.bfloat16), weights,
                                   blocks, config).sum(dim=1)
    assert rel_err(out, plain) < 1e-2


def test_the_fp8_layer_replays_new_routings_in_a_cuda_graph() -> None:
    block = fp8_block_30b(seed=1)
    static_x = torch.zeros(16, HIDDEN, device="cuda", dtype=torch.bfloat16)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        block(static_x)  # compile and warm up outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = block(static_x)
    for seed in range(3):
        x = torch.randn(16, HIDDEN, device="cuda", dtype=torch.bfloat16,
                        generator=torch.Generator(device="cuda").manual_seed(seed))
        if seed == 2:
            x[8:] = 0  # PAD rows, as a padded decode batch has
        static_x.copy_(x)
        graph.replay()
        torch.testing.assert_close(static_out, block(x))


#: a medium Qwen3-MoE: Qwen3-30B-A3B's attention and expert widths, fewer layers,
#: experts and vocabulary (so the checkpoint is written in seconds)
MEDIUM = dict(hidden=2048, layers=4, heads=32, kv_heads=4, head_dim=128, experts=32, top_k=8,
              inter=768, vocab=32768)


def _write_medium(path: Path) -> Path:
    s, g = MEDIUM, torch.Generator(device="cuda").manual_seed(0)
    h, d = s["hidden"], s["head_dim"]

    def w(*shape: int, std: float = 0.02) -> torch.Tensor:
        return (torch.randn(*shape, device="cuda", generator=g) * std).to(torch.bfloat16).cpu()

    t = {"model.embed_tokens.weight": w(s["vocab"], h, std=1.0),
         "model.norm.weight": torch.ones(h, dtype=torch.bfloat16),
         "lm_head.weight": w(s["vocab"], h, std=0.1)}
    for i in range(s["layers"]):
        p = f"model.layers.{i}."
        for name in ("input_layernorm", "post_attention_layernorm"):
            t[p + name + ".weight"] = torch.ones(h, dtype=torch.bfloat16)
        for name in ("q_norm", "k_norm"):
            t[p + "self_attn." + name + ".weight"] = torch.ones(d, dtype=torch.bfloat16)
        t[p + "self_attn.q_proj.weight"] = w(s["heads"] * d, h)
        t[p + "self_attn.k_proj.weight"] = w(s["kv_heads"] * d, h)
        t[p + "self_attn.v_proj.weight"] = w(s["kv_heads"] * d, h)
        t[p + "self_attn.o_proj.weight"] = w(h, s["heads"] * d)
        t[p + "mlp.gate.weight"] = w(s["experts"], h)
        for e in range(s["experts"]):
            t[p + f"mlp.experts.{e}.gate_proj.weight"] = w(s["inter"], h)
            t[p + f"mlp.experts.{e}.up_proj.weight"] = w(s["inter"], h)
            t[p + f"mlp.experts.{e}.down_proj.weight"] = w(h, s["inter"])
    path.mkdir(parents=True)
    save_file(t, str(path / "model.safetensors"))
    config = {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe",
              "torch_dtype": "bfloat16", "hidden_size": h, "intermediate_size": 6144,
              "moe_intermediate_size": s["inter"], "num_experts": s["experts"],
              "num_experts_per_tok": s["top_k"], "norm_topk_prob": True,
              "decoder_sparse_step": 1, "mlp_only_layers": [],
              "num_hidden_layers": s["layers"], "num_attention_heads": s["heads"],
              "num_key_value_heads": s["kv_heads"], "head_dim": d, "vocab_size": s["vocab"],
              "max_position_embeddings": 4096, "rms_norm_eps": 1e-6, "rope_theta": 1e6,
              "tie_word_embeddings": False, "eos_token_id": 0}
    (path / "config.json").write_text(json.dumps(config))
    return path


def test_fp8_moe_logprobs_and_greedy_tokens_stay_within_rounding_of_bf16(tmp_path):
    def experts_are_fp8(llm: LLM) -> None:
        experts = llm.runner.model.model.layers[0].mlp.experts
        assert experts.w13.dtype == torch.float8_e4m3fn

    stays_within_rounding_of_bf16(_write_medium(tmp_path / "moe"), MEDIUM["vocab"],
                                  experts_are_fp8)


def test_a_push_and_a_sleep_with_graphs_captured_serve_the_pushed_experts(tmp_path):
    pushes_and_sleep_serve_the_pushed_weights(tmp_path, "qwen3-moe-blocks")
