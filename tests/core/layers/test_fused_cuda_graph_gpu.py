"""On CUDA the fused kernels are compiled, captured in a CUDA graph and replayed.

Capture fails on a host sync (``.item()``, a data-dependent shape); replaying a
graph over fresh inputs then shows the kernels read their (static) input buffers
each time rather than values baked in at capture. The oracle is each module's
torch path on CPU.
"""

from __future__ import annotations

import copy

import pytest
import torch
from fused_testing import assert_same_values, operand_scale, triton_path

from kvrunner.layers.activation import silu_and_mul
from kvrunner.layers.fused import qk_norm_rope
from kvrunner.layers.rmsnorm import RMSNorm, ZeroCenteredRMSNorm
from kvrunner.layers.rotary import RotaryEmbedding

pytestmark = pytest.mark.gpu

T, HIDDEN, HQ, HK, D, INTER = 4, 64, 4, 2, 32, 96


@pytest.mark.parametrize("norm_cls", [RMSNorm, ZeroCenteredRMSNorm])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_fused_kernels_replay_in_a_cuda_graph(norm_cls: type[RMSNorm],
                                              dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(0)

    def norm(dim: int) -> RMSNorm:
        module = norm_cls(dim, 1e-6, dtype=dtype, device="cuda")
        module.weight.data = (0.3 * torch.randn(dim, generator=gen)).to(dtype).cuda() + (
            0.0 if norm_cls is ZeroCenteredRMSNorm else 1.0
        )
        return module

    layer_norm, q_norm, k_norm = norm(HIDDEN), norm(D), norm(D)
    rope = RotaryEmbedding(D, max_position=128, base=10000.0, rotary_dim=D // 2, device="cuda")
    act = silu_and_mul
    static = {
        "x": torch.zeros(T, HIDDEN, dtype=dtype, device="cuda"),
        "residual": torch.zeros(T, HIDDEN, dtype=dtype, device="cuda"),
        "qkv": torch.zeros(T, (HQ + 2 * HK) * D, dtype=dtype, device="cuda"),
        "positions": torch.zeros(T, dtype=torch.long, device="cuda"),
        "gate_up": torch.zeros(T, 2 * INTER, dtype=dtype, device="cuda"),
    }

    def split(qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return qkv[:, : HQ * D].view(-1, HQ, D), qkv[:, HQ * D : (HQ + HK) * D].view(-1, HK, D)

    def step(s: dict[str, torch.Tensor]) -> tuple[torch.Tensor, ...]:
        h, res = layer_norm(s["x"], s["residual"])
        q, k = qk_norm_rope(s["positions"], *split(s["qkv"]), q_norm, k_norm, rope)
        return h, res, q, k, act(s["gate_up"])

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step(static)  # compile every kernel before capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outputs = step(static)

    cpu = {m: copy.deepcopy(m).cpu() for m in (layer_norm, q_norm, k_norm, rope)}
    for seed in (1, 2):
        fresh = torch.Generator().manual_seed(seed)
        inputs = {
            name: (torch.randint(0, 128, (T,), generator=fresh) if name == "positions"
                   else torch.randn(buf.shape, generator=fresh).to(dtype))
            for name, buf in static.items()
        }
        for name, value in inputs.items():
            static[name].copy_(value)
        graph.replay()
        torch.cuda.synchronize()
        with triton_path(False):
            h, res = cpu[layer_norm](inputs["x"], inputs["residual"])
            q, k = split(inputs["qkv"])
            qn, kn = cpu[q_norm](q), cpu[k_norm](k)
            rq, rk = cpu[rope](inputs["positions"], qn, kn)
            expected = (h, res, rq, rk, act(inputs["gate_up"]))
        norm_roundings = 1 if norm_cls is ZeroCenteredRMSNorm else 2
        roundings = (1 + norm_roundings, 1, norm_roundings + 1, norm_roundings + 1, 2)
        scales = (0.0, 0.0, operand_scale(qn), operand_scale(kn), 0.0)
        for out, ref, n, scale in zip(outputs, expected, roundings, scales, strict=True):
            assert_same_values(out.cpu(), ref, roundings=n, scale=scale)
