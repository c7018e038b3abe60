"""Time the GDN kernels at Qwen3-Next-like shapes on a GPU and check them against the torch path.

Usage: ``python backends/gdn/scripts/bench_kernels.py`` (needs CUDA). Prints one line
per measurement: kernel, shape, median microseconds, and the relative RMS difference
to the plain-torch path at the same shape.
"""

from __future__ import annotations

import torch
import triton.testing

from kvrunner_gdn.kernels.chunked_prefill import gdn_prefill_torch, gdn_prefill_triton
from kvrunner_gdn.kernels.conv_prefill import conv1d_prefill_torch, conv1d_prefill_triton
from kvrunner_gdn.kernels.conv_update import conv1d_update_torch, conv1d_update_triton
from kvrunner_gdn.kernels.recurrent_decode import gdn_decode_torch, gdn_decode_triton

HK, HV, DK, DV, WIDTH = 16, 32, 128, 128, 4


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).pow(2).mean().sqrt() / b.double().pow(2).mean().sqrt()).item()


def bench_decode(batch: int, slots: int) -> None:
    dev = "cuda"
    q, k = (torch.randn(batch, HK, DK, device=dev, dtype=torch.bfloat16) for _ in range(2))
    v = torch.randn(batch, HV, DV, device=dev, dtype=torch.bfloat16)
    g = -torch.rand(batch, HV, device=dev)
    beta = torch.rand(batch, HV, device=dev)
    pool = torch.randn(slots, HV, DK, DV, device=dev) * 0.1
    idx = torch.randperm(slots, device=dev)[:batch].to(torch.int32)
    ref_pool = pool.clone()
    out = gdn_decode_triton(q, k, v, g, beta, pool, idx, idx, DK**-0.5)
    ref = gdn_decode_torch(q, k, v, g, beta, ref_pool, idx, idx, DK**-0.5)
    err = max(rel(out.float(), ref.float()), rel(pool, ref_pool))
    ms = triton.testing.do_bench(lambda: gdn_decode_triton(q, k, v, g, beta, pool, idx, idx,
                                                           DK**-0.5))
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
    p1, p2 = pool.clone(), pool.clone()
    err = rel(conv1d_update_triton(x, p1, w, None, idx, idx).float(),
              conv1d_update_torch(x, p2, w, None, idx, idx).float())
    ms = triton.testing.do_bench(lambda: conv1d_update_triton(x, pool, w, None, idx, idx))
    print(f"conv_update B{batch} D{dim}: {ms * 1e3:.1f} us, rel vs torch {err:.2e}")
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], device=dev, dtype=torch.int32)
    xs = torch.randn(sum(lens), dim, device=dev, dtype=torch.bfloat16)
    sidx = idx[: len(lens)]
    read = sidx.clone()
    p1, p2 = pool.clone(), pool.clone()
    err = rel(conv1d_prefill_triton(xs, p1, w, None, cu, read, sidx, max(lens)).float(),
              conv1d_prefill_torch(xs, p2, w, None, cu, read, sidx, max(lens)).float())
    err = max(err, rel(p1, p2))
    ms = triton.testing.do_bench(
        lambda: conv1d_prefill_triton(xs, pool, w, None, cu, read, sidx, max(lens)))
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
    p1, p2 = pool.clone(), pool.clone()
    o1 = gdn_prefill_triton(q, k, v, g, beta, p1, cu, idx, idx, DK**-0.5, chunk_size=chunk)
    o2 = gdn_prefill_torch(q, k, v, g, beta, p2, cu, idx, idx, DK**-0.5, chunk_size=chunk)
    err = max(rel(o1.float(), o2.float()), rel(p1, p2))
    ms = triton.testing.do_bench(
        lambda: gdn_prefill_triton(q, k, v, g, beta, pool, cu, idx, idx, DK**-0.5,
                                   chunk_size=chunk))
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
