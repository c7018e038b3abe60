"""The w8a16 kernel on CUDA: within bf16 rounding of the dequantizing reference at the
Qwen3-0.6B and 8B projections, the path ``fp8_linear`` takes for a small decode step's rows,
capturable in a CUDA graph, and an FP8 engine whose captured graphs run it.

Bound stated here: each bf16 output within ``2^-8 * |ref| + K * 2^-23 * (|x| @ |W|^T)``
of ``ref = x @ dequantize_blocks(W, s, bf16).T`` computed in float64 (half a bf16 step
for the output's one rounding, float32 accumulation of K products for the rest).
"""

from __future__ import annotations

import pytest
import torch

from kvrunner import LLM, SamplingParams
from kvrunner.layers.fp8.blocks import dequantize_blocks, quantize_blocks
from kvrunner.layers.fp8.gemm import fp8_linear, w8a8_serves, w8a16_serves
from kvrunner.layers.fp8.w8a16_triton import MAX_ROWS, MAX_ROWS_BESIDE_W8A8, w8a16_linear
from kvrunner.models.tiny import write_tiny_checkpoint

pytestmark = pytest.mark.gpu

#: (N, K) of q|k|v, o, gate|up and down at the Qwen3-0.6B and Qwen3-8B shapes
PROJECTIONS = {
    "0.6b": [(4096, 1024), (1024, 2048), (6144, 1024), (1024, 3072)],
    "8b": [(6144, 4096), (4096, 4096), (24576, 4096), (4096, 12288)],
}
SHAPES = [(shape, n, k) for shape, nks in PROJECTIONS.items() for n, k in nks]


def _operands(rows: int, n: int, k: int):
    g = torch.Generator(device="cuda").manual_seed(rows * n + k)
    w = torch.randn(n, k, device="cuda", generator=g) * 0.02
    x = torch.randn(rows, k, device="cuda", generator=g).to(torch.bfloat16)
    return x, *quantize_blocks(w)


@pytest.mark.parametrize("rows", [1, 7, 64, 256])
@pytest.mark.parametrize(("shape", "n", "k"), SHAPES)
def test_the_kernel_is_within_bf16_rounding_of_the_reference(rows, shape, n, k):
    """Every decode step's row count, whichever path ``fp8_linear`` picks for it."""
    x, wq, ws = _operands(rows, n, k)
    y = w8a16_linear(x, wq, ws)
    if rows <= MAX_ROWS_BESIDE_W8A8:
        assert w8a16_serves(x, wq), "a small decode step's rows take w8a16"
        assert torch.equal(fp8_linear(x, wq, ws), y), "fp8_linear's product is the kernel's"
    w = dequantize_blocks(wq, ws, torch.bfloat16).double()
    ref = x.double() @ w.T
    bound = 2.0**-8 * ref.abs() + k * 2.0**-23 * (x.double().abs() @ w.abs().T)
    assert ((y.double() - ref).abs() <= bound).all(), (y.double() - ref).abs().max()


def test_more_rows_than_a_decode_step_leave_the_kernel():
    """Where the w8a8 product serves (N a multiple of 16, on an H100/H200) it takes more
    than ``MAX_ROWS_BESIDE_W8A8`` rows; elsewhere the kernel takes up to ``MAX_ROWS``."""
    x, wq, _ = _operands(MAX_ROWS + 1, 1024, 1024)
    if w8a8_serves(x, wq):
        assert w8a16_serves(x[:MAX_ROWS_BESIDE_W8A8], wq)
        assert not w8a16_serves(x[:MAX_ROWS_BESIDE_W8A8 + 1], wq)
    x, wq, _ = _operands(MAX_ROWS + 1, 1000, 1024)  # no w8a8: N is not a multiple of 16
    assert not w8a8_serves(x, wq)
    assert not w8a16_serves(x, wq)
    assert w8a16_serves(x[:MAX_ROWS], wq)
    assert not w8a16_serves(x[:MAX_ROWS].float(), wq), "float32 activations dequantize"


@pytest.mark.parametrize("rows", [1, 64, 256])
def test_a_captured_graph_replays_what_eager_computes(rows):
    """Capture with one input, replay with another: no host sync in the launch, and the
    replay equals the eager product of the new input bit for bit (8B down: K split)."""
    x, wq, ws = _operands(rows, 4096, 12288)
    static = x.clone()
    w8a16_linear(static, wq, ws)  # compiled before capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = w8a16_linear(static, wq, ws)
    static.copy_(torch.randn_like(x))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, w8a16_linear(static, wq, ws))


def test_an_fp8_engine_with_cuda_graphs_generates_the_eager_engines_tokens(tmp_path):
    """bf16 (the w8a16 path's dtype), batches of exactly a captured size (no padding):
    the decode graphs run the kernel and give the eager engine's greedy tokens."""
    path = write_tiny_checkpoint(tmp_path / "q", kind="qwen3-blocks", seed=0)
    settings = dict(dtype="bfloat16", quantization="fp8", max_num_seqs=4, max_model_len=128,
                    capture_sizes=(1, 2, 4), gpu_memory_utilization=0.3, audit=True)
    greedy = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    graphs = LLM(model=str(path), **settings)
    eager = LLM(model=str(path), enforce_eager=True, **settings)
    captured = graphs.runner.graph_capture.graphs
    assert captured and all(g._graph is not None for g in captured.values()), "real graphs"
    g = torch.Generator().manual_seed(0)
    for batch in (1, 2, 4):
        prompts = [torch.randint(1, 400, (5 + i,), generator=g).tolist() for i in range(batch)]
        got = [o.token_ids for o in graphs.generate(prompts, greedy)]
        assert all(len(t) == 16 for t in got)
        assert got == [o.token_ids for o in eager.generate(prompts, greedy)], f"batch {batch}"
    assert graphs.runner.launcher.nan_rows == 0
