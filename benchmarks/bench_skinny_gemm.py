"""Decode-sized projections: the skinny-GEMM Triton kernel vs cuBLAS (``F.linear``).

The weight shapes of one Qwen3-0.6B and one Qwen3-8B decoder layer (fused QKV,
o_proj, fused gate/up, down), bf16, at M = 1, 8 and 64 rows. Each side is captured
in a CUDA graph of 20 calls on distinct weights (so no call finds its weight in L2),
as the decode graph runs them, and timed per call. Prints µs, the weight bytes read
per µs against the measured copy bandwidth (the floor), ours / cuBLAS, and the
relative error of each against a float32 product, and marks (``auto``) the cases the
default dispatch (``KVRUNNER_SKINNY_GEMM=auto``) sends to the kernel.

    python benchmarks/bench_skinny_gemm.py
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from common import copy_bandwidth_tbps, median_ms, rel_err

from kvrunner.layers.fused.dispatch import SKINNY_GEMM_AUTO_MIN_K
from kvrunner.layers.fused.skinny_gemm_triton import choose_splits, skinny_gemm

#: (model, projection, N, K) of one layer at tensor-parallel size 1
SHAPES = [
    ("0.6B", "qkv", 4096, 1024), ("0.6B", "o", 1024, 2048),
    ("0.6B", "gate_up", 6144, 1024), ("0.6B", "down", 1024, 3072),
    ("8B", "qkv", 6144, 4096), ("8B", "o", 4096, 4096),
    ("8B", "gate_up", 24576, 4096), ("8B", "down", 4096, 12288),
]  # fmt: skip
ROWS = (1, 8, 64)
CALLS = 20


def graph_us(fn, xs: list[torch.Tensor], ws: list[torch.Tensor]) -> float:
    """µs per call of ``fn`` replayed from a CUDA graph of ``CALLS`` calls."""
    for x, w in zip(xs, ws, strict=True):
        fn(x, w)  # compile, settle workspaces
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for x, w in zip(xs, ws, strict=True):
            fn(x, w)
    return median_ms(graph.replay) * 1e3 / CALLS


def main() -> None:
    bw = copy_bandwidth_tbps()
    print(f"copy bandwidth {bw:.2f} TB/s; {CALLS} calls per graph on distinct weights")
    print(f"{'model':>5} {'proj':>7} {'M':>3} {'splits':>6} {'cuBLAS us':>9} {'ours us':>8} "
          f"{'floor us':>8} {'ours/cuBLAS':>11} {'ours TB/s':>9} {'err cuBLAS':>10} "
          f"{'err ours':>9}")
    worse, auto = 0, []
    for model, proj, n, k in SHAPES:
        g = torch.Generator(device="cuda").manual_seed(n + k)
        ws = [torch.randn(n, k, device="cuda", generator=g).to(torch.bfloat16) * 0.02
              for _ in range(CALLS)]
        for m in ROWS:
            xs = [torch.randn(m, k, device="cuda", generator=g).to(torch.bfloat16)
                  for _ in range(CALLS)]
            ref = xs[0].float() @ ws[0].float().T
            err_blas = rel_err(F.linear(xs[0], ws[0]), ref)
            err_ours = rel_err(skinny_gemm(xs[0], ws[0]), ref)
            blas = graph_us(F.linear, xs, ws)
            ours = graph_us(skinny_gemm, xs, ws)
            nbytes = n * k * 2 + m * (n + k) * 2
            floor = nbytes / (bw * 1e12) * 1e6
            worse += ours > blas
            picked = m == 1 and k >= SKINNY_GEMM_AUTO_MIN_K  # the dispatch's auto rule
            if picked:
                auto.append(ours / blas)
            print(f"{model:>5} {proj:>7} {m:>3} {choose_splits(n, k):>6} {blas:>9.2f} "
                  f"{ours:>8.2f} {floor:>8.2f} {ours / blas:>11.2f} "
                  f"{nbytes / (ours * 1e-6) / 1e12:>9.2f} {err_blas:>10.1e} {err_ours:>9.1e}"
                  f"{'  auto' if picked else ''}")
    print(f"ours slower than cuBLAS in {worse} of {len(SHAPES) * len(ROWS)} cases; "
          f"the {len(auto)} cases auto sends here: ours/cuBLAS {min(auto):.2f}-{max(auto):.2f}")


if __name__ == "__main__":
    main()
