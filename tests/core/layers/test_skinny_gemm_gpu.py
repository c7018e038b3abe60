"""On CUDA: the skinny-GEMM kernel in bf16 at the real decode shapes equals a float32
product to bf16 rounding, and replays from a CUDA graph (workspace included)."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("m", [1, 7, 64])
@pytest.mark.parametrize(("n", "k"), [(4096, 1024), (1024, 3072), (6144, 4096)])
def test_bf16_equals_the_float32_product_eagerly_and_replayed(m: int, n: int, k: int) -> None:
    from kvrunner.layers.fused.skinny_gemm_triton import skinny_gemm

    g = torch.Generator(device="cuda").manual_seed(m + n + k)
    x = torch.randn(m, k, device="cuda", generator=g).to(torch.bfloat16)
    w = (torch.randn(n, k, device="cuda", generator=g) * 0.02).to(torch.bfloat16)
    ref = x.float() @ w.float().T
    eager = skinny_gemm(x, w)
    torch.testing.assert_close(eager.float(), ref, rtol=2**-7, atol=2**-7 * ref.abs().max().item())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        replayed = skinny_gemm(x, w)
    x.copy_(torch.randn(m, k, device="cuda", generator=g).to(torch.bfloat16))
    graph.replay()
    assert torch.equal(replayed, skinny_gemm(x, w))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("m", [1, 8, 64])
@pytest.mark.parametrize(("n", "k"), [(1024, 3072), (4096, 12288)])
def test_bf16_swiglu_down_projection_is_the_activation_then_the_product(
    m: int, n: int, k: int
) -> None:
    """The down projections of the 0.6B and 8B shapes with the activation fused in:
    bit for bit the activation's kernel and then the same launch, on the compiled
    kernels."""
    from kvrunner.layers.fused.silu_mul_triton import silu_mul_triton
    from kvrunner.layers.fused.skinny_gemm_triton import skinny_gemm

    g = torch.Generator(device="cuda").manual_seed(m + n + k)
    gate_up = (3 * torch.randn(m, 2 * k, device="cuda", generator=g)).to(torch.bfloat16)
    w = (torch.randn(n, k, device="cuda", generator=g) * 0.02).to(torch.bfloat16)
    assert torch.equal(skinny_gemm(gate_up, w, silu_mul=True),
                       skinny_gemm(silu_mul_triton(gate_up), w))
