"""Time the GDN kernels at Qwen3-Next-like shapes on a GPU and check them against the torch path.

Usage: ``python backends/gdn/scripts/bench_kernels.py`` (needs CUDA). Prints one line
per measurement: kernel, shape, median microseconds, and the relative RMS difference
to the plain-torch path at the same shape.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import triton.testing

from kvrunner_gdn.ops.gated_delta_rule.chunk import chunk_gated_delta_rule
from kvrunner_gdn.ops.gated_delta_rule.chunk_torch import chunk_gated_delta_rule_torch
from kvrunner_gdn.ops.gated_delta_rule.fused_recurrent import fused_recurrent_gated_delta_rule
from kvrunner_gdn.ops.gated_delta_rule.fused_recurrent_torch import (
    fused_recurrent_gated_delta_rule_torch,
)
from kvrunner_gdn.ops.gated_delta_rule.inputs import GatedDeltaRuleInputs
from kvrunner_gdn.ops.short_conv.inputs import ShortConvInputs
from kvrunner_gdn.ops.short_conv.prefill import short_conv_prefill
from kvrunner_gdn.ops.short_conv.prefill_torch import short_conv_prefill_torch
from kvrunner_gdn.ops.short_conv.update import short_conv_update
from kvrunner_gdn.ops.short_conv.update_torch import short_conv_update_torch

HK, HV, DK, DV, WIDTH = 16, 32, 128, 128, 4


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).pow(2).mean().sqrt() / b.double().pow(2).mean().sqrt()).item()


def against_torch(kernel: Callable[..., torch.Tensor], torch_path: Callable[..., torch.Tensor],
                  inputs: Callable[[torch.Tensor], Any], pool: torch.Tensor) -> tuple[float, float]:
    """(median ms of ``kernel``, relative RMS of its output and pool to the torch path's),
    each run from its own copy of ``pool``; ``inputs(pool)`` builds the op's record."""
    p1, p2 = pool.clone(), pool.clone()
    err = max(rel(kernel(inputs=inputs(p1)).float(), torch_path(inputs=inputs(p2)).float()),
              rel(p1, p2))
    timed = inputs(pool)
    return triton.testing.do_bench(lambda: kernel(inputs=timed)), err


def bench_decode(batch: int, slots: int) -> None:
    dev = "cuda"
    q, k = (torch.randn(batch, HK, DK, device=dev, dtype=torch.bfloat16) for _ in range(2))
    v = torch.randn(batch, HV, DV, device=dev, dtype=torch.bfloat16)
    g = -torch.rand(batch, HV, device=dev)
    beta = torch.rand(batch, HV, device=dev)
    pool = torch.randn(slots, HV, DK, DV, device=dev) * 0.1
    idx = torch.randperm(slots, device=dev)[:batch].to(torch.int32)
    ms, err = against_torch(
        fused_recurrent_gated_delta_rule, fused_recurrent_gated_delta_rule_torch,
        lambda p: GatedDeltaRuleInputs(q=q, k=k, v=v, g=g, beta=beta, state=p, read_indices=idx,
                                       write_indices=idx, scale=DK**-0.5), pool)
    moved = 2 * batch * HV * DK * DV * 4
    print(f"gdn_decode B{batch} Hv{HV} K{DK} V{DV}: {ms * 1e3:.1f} us "
          f"({moved / ms / 1e9:.2f} TB/s state r+w), rel vs torch {err:.2e}")


def bench_conv(batch: int, lens: list[int], slots: int) -> None:
    dev = "cuda"
    dim = 2 * HK * DK + HV * DV
    w = torch.randn(dim, WIDTH, device=dev)
    pool = torch.randn(slots, dim, WIDTH - 1, device=dev)
    x = torch.randn(batch, dim, device=dev, dtype=torch.bfloat16)
    idx = torch.randperm(slots, device=dev)[:batch].to(torch.int32)
    ms, err = against_torch(
        short_conv_update, short_conv_update_torch,
        lambda p: ShortConvInputs(x=x, conv_state=p, weight=w, read_indices=idx,
                                  write_indices=idx), pool)
    print(f"conv_update B{batch} D{dim}: {ms * 1e3:.1f} us, rel vs torch {err:.2e}")
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], device=dev, dtype=torch.int32)
    xs = torch.randn(sum(lens), dim, device=dev, dtype=torch.bfloat16)
    sidx = idx[: len(lens)]
    ms, err = against_torch(
        short_conv_prefill, short_conv_prefill_torch,
        lambda p: ShortConvInputs(x=xs, conv_state=p, weight=w, read_indices=sidx.clone(),
                                  write_indices=sidx, cu_seqlens=cu, max_seqlen=max(lens)), pool)
    print(f"conv_prefill lens{lens} D{dim}: {ms * 1e3:.1f} us, rel vs torch {err:.2e}")


def bench_prefill(lens: list[int], slots: int, chunk: int) -> None:
    dev = "cuda"
    t = sum(lens)
    q, k = (torch.randn(t, HK, DK, device=dev, dtype=torch.bfloat16) for _ in range(2))
    v = torch.randn(t, HV, DV, device=dev, dtype=torch.bfloat16)
    g = -torch.rand(t, HV, device=dev) * 0.5
    beta = torch.rand(t, HV, device=dev)
    pool = torch.randn(slots, HV, DK, DV, device=dev) * 0.1
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], device=dev, dtype=torch.int32)
    idx = torch.randperm(slots, device=dev)[: len(lens)].to(torch.int32)
    ms, err = against_torch(
        chunk_gated_delta_rule, chunk_gated_delta_rule_torch,
        lambda p: GatedDeltaRuleInputs(q=q, k=k, v=v, g=g, beta=beta, state=p, read_indices=idx,
                                       write_indices=idx, scale=DK**-0.5, cu_seqlens=cu,
                                       chunk_size=chunk), pool)
    print(f"gdn_prefill lens{lens} chunk{chunk}: {ms * 1e3:.1f} us "
          f"({t / ms / 1e3:.1f} Mtok/s), rel vs torch {err:.2e}")


if __name__ == "__main__":
    print(torch.cuda.get_device_name(), "torch", torch.__version__, "triton", triton.__version__)
    for b in (1, 64, 256):
        bench_decode(b, 512)
    bench_conv(64, [512, 1000, 7], 512)
    for chunk in (64, 32, 16):
        bench_prefill([4096], 16, chunk)
        bench_prefill([512] * 8, 16, chunk)
