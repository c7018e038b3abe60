"""FP8 weights on CUDA: the product against the dequantized reference, an engine's
logprobs and greedy tokens against bf16's at the Qwen3-0.6B shape, and pushes and sleep
with graphs captured.

Bounds stated here:

* the product: each output within ``2^-4 * (|x| @ |W|^T) + 2^-7 * |ref| + 1e-3`` of
  ``x @ dequant(W)^T`` in float32 (the 1 x 128 activation groups round each input by
  at most half an e4m3 step, 2^-4 relative; the result is rounded to bf16);
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
import torch.nn.functional as F
from safetensors.torch import save_file

from kvrunner.layers.fp8.blocks import dequantize_blocks, quantize_blocks
from kvrunner.layers.fp8.gemm import fp8_linear, w8a8_linear, w8a8_serves, w8a16_serves

from .engine_kit import pushes_and_sleep_serve_the_pushed_weights, stays_within_rounding_of_bf16

pytestmark = pytest.mark.gpu

QWEN3_06B = dict(hidden=1024, inter=3072, layers=28, heads=16, kv_heads=8, head_dim=128,
                 vocab=151936)


@pytest.mark.parametrize("rows", [1, 7, 17, 26, 64, 256, 4096])
@pytest.mark.parametrize(("n", "k"), [(4096, 1024), (1024, 2048), (6144, 1024), (1024, 3072)])
def test_the_product_is_within_the_stated_bound_of_the_dequantized_reference(rows, n, k):
    g = torch.Generator(device="cuda").manual_seed(rows * n + k)
    w = torch.randn(n, k, device="cuda", generator=g) * 0.02
    x = torch.randn(rows, k, device="cuda", generator=g).to(torch.bfloat16)
    wq, ws = quantize_blocks(w)
    y = fp8_linear(x, wq, ws).float()
    if torch.cuda.get_device_capability() == (9, 0) and not w8a16_serves(x, wq):
        # past a decode step's rows an H100/H200 multiplies in FP8 (torch's scaled_mm),
        # and a refused call would have left the shape dequantizing
        assert w8a8_serves(x, wq), "an H100/H200 must take the w8a8 path past w8a16's rows"
    dq = dequantize_blocks(wq, ws)
    ref = F.linear(x.float(), dq)
    bound = 2**-4 * F.linear(x.float().abs(), dq.abs()) + 2**-7 * ref.abs() + 1e-3
    assert ((y - ref).abs() <= bound).all()


@pytest.mark.parametrize("rows", [17, 64, 256, 4096])
@pytest.mark.parametrize(("n", "k"), [(6144, 4096), (4096, 4096), (24576, 4096), (4096, 12288)])
def test_the_triton_w8a8_kernel_is_the_exact_product_of_its_operands_to_bf16(rows, n, k):
    """At the 8B projections' shapes: the Triton kernel's bf16 output lies within the
    tensor cores' FP8 accumulation and one bf16 rounding of the exact product of the
    quantized activations and weight, and torch's ``scaled_mm`` on the same operands
    within the same bound. Hopper's FP8 MMA keeps about 14 bits while it sums a block
    (DeepSeek-V3's report, sec. 3.3.2), which both kernels promote to float32 every
    128-deep block: 2^-12 of the block sums' magnitudes covers it (the CPU test,
    ``test_fp8_w8a8_triton.py``, holds the interpreter to float32's own bound). A
    wrong scale or block moves an output by its own size, far past the bound."""
    from kvrunner.layers.fp8.token_groups_triton import quantize_token_groups_triton
    from kvrunner.layers.fp8.w8a8_triton import w8a8_block_linear

    g = torch.Generator(device="cuda").manual_seed(rows * n + k)
    wq, ws = quantize_blocks(torch.randn(n, k, device="cuda", generator=g) * 0.02)
    x = torch.randn(rows, k, device="cuda", generator=g).to(torch.bfloat16)
    xq, xs = quantize_token_groups_triton(x)
    y = w8a8_block_linear(xq, xs, wq, ws, torch.bfloat16).double()
    xd = (xq.double().view(rows, -1, 128) * xs.double()[:, :, None]).view(rows, k)
    wd = dequantize_blocks(wq, ws).double()
    exact = xd @ wd.T
    bound = (xd.abs() @ wd.abs().T) * 2.0**-12 + 2.0**-8 * exact.abs()
    assert ((y - exact).abs() <= bound).all(), (y - exact).abs().max()
    if w8a8_serves(x, wq):
        assert ((w8a8_linear(x, wq, ws).double() - exact).abs() <= bound).all()


def _write_06b(path: Path) -> Path:
    s, g = QWEN3_06B, torch.Generator(device="cuda").manual_seed(0)
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
        t[p + "mlp.gate_proj.weight"] = w(s["inter"], h)
        t[p + "mlp.up_proj.weight"] = w(s["inter"], h)
        t[p + "mlp.down_proj.weight"] = w(h, s["inter"])
    path.mkdir(parents=True)
    save_file(t, str(path / "model.safetensors"))
    config = {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3",
              "torch_dtype": "bfloat16", "hidden_size": h, "intermediate_size": s["inter"],
              "num_hidden_layers": s["layers"], "num_attention_heads": s["heads"],
              "num_key_value_heads": s["kv_heads"], "head_dim": d, "vocab_size": s["vocab"],
              "max_position_embeddings": 4096, "rms_norm_eps": 1e-6, "rope_theta": 1e6,
              "tie_word_embeddings": False, "eos_token_id": 0}
    (path / "config.json").write_text(json.dumps(config))
    return path


def test_fp8_logprobs_and_greedy_tokens_stay_within_rounding_of_bf16_at_the_06b_shape(tmp_path):
    stays_within_rounding_of_bf16(_write_06b(tmp_path / "q06b"), QWEN3_06B["vocab"])


def test_a_push_and_a_sleep_with_graphs_captured_serve_the_pushed_weights(tmp_path):
    pushes_and_sleep_serve_the_pushed_weights(tmp_path, "qwen3-blocks")


@pytest.mark.parametrize("rows", [1, 7, 256, 4096])
@pytest.mark.parametrize("spread", [1e-3, 1.0, 300.0])
def test_the_activation_kernel_gives_the_references_bytes_and_scales(rows, spread):
    """The w8a8 path's one-launch quantization equals the torch reference bit for bit."""
    from kvrunner.layers.fp8.gemm import quantize_token_groups
    from kvrunner.layers.fp8.token_groups_triton import quantize_token_groups_triton

    g = torch.Generator(device="cuda").manual_seed(rows)
    x = (torch.randn(rows, 3072, device="cuda", generator=g) * spread).to(torch.bfloat16)
    x[0, :128] = 0
    q, s = quantize_token_groups_triton(x)
    q_ref, s_ref = quantize_token_groups(x)
    assert torch.equal(s, s_ref)
    assert torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8))


@pytest.mark.parametrize(("m", "n"), [(4096, 1024), (300, 200), (1, 129)])
@pytest.mark.parametrize("values", ["normal", "near_max", "subnormal"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_the_push_quantizes_in_place_to_the_cpu_references_bytes_and_scales(m, n, values,
                                                                            dtype):
    """A push's one-launch block quantization on CUDA equals the torch reference run on
    the CPU bit for bit (the same bytes on every device), written into a view."""
    from kvrunner.layers.fp8.blocks import FP8_DTYPE, scale_shape
    from kvrunner.layers.fp8.weights import quantize_blocks_into

    g = torch.Generator().manual_seed(m + n)
    w = torch.randn(m, n, generator=g) * 0.02
    if values == "near_max":
        w = w.sign() * (0.9 + 0.1 * torch.rand(m, n, generator=g))
    elif values == "subnormal":  # each block's amax 1, the rest under e4m3's normals
        w = w.clamp(-3, 3) * 2.0**-8 / 448
        w[::128, ::128] = 1.0
    w = w.to(dtype)
    q_ref, s_ref = quantize_blocks(w)
    q = torch.empty(m + 128, n, dtype=FP8_DTYPE, device="cuda")
    s = torch.empty(1 + scale_shape((m, n))[0], scale_shape((m, n))[1], device="cuda")
    quantize_blocks_into(w.cuda(), q[128:], s[1:])
    assert torch.equal(s[1:].cpu(), s_ref)
    assert torch.equal(q[128:].cpu().view(torch.uint8), q_ref.view(torch.uint8))
