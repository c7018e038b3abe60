"""Decode-sized projections: the skinny-GEMM Triton kernel vs cuBLAS (``F.linear``).

The weight shapes of one Qwen3-0.6B and one Qwen3-8B decoder layer (fused QKV,
o_proj, fused gate/up, down), bf16, at M = 1, 8 and 64 rows. Each side is captured
in a CUDA graph of 20 calls on distinct weights (so no call finds its weight in L2),
as the decode graph runs them, and timed per call. Prints µs, the weight bytes read
per µs against the measured copy bandwidth (the floor), ours / cuBLAS, and the
relative error of each against a float32 product, and marks (``auto``) the cases the
projections' dispatch sends to the kernel (``[kernels] skinny_gemm``, default
``auto``). ``--sweep`` also times every candidate launch (tile shape, split of K,
the one-row GEMV kernel) per case and prints the fastest beside ``default_launch``'s.

``--swiglu`` times the two down projections with the SwiGLU activation before them,
at 1-64 rows: what cuBLAS needs (the activation's kernel, then ``F.linear``) against
the one skinny launch that forms ``silu(gate) * up`` as it reads ``[gate | up]``
(``project_silu_mul``'s fused path), each in a graph of 20 calls as above.

    python benchmarks/bench_skinny_gemm.py [--sweep] [--swiglu]
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from common import copy_bandwidth_tbps, median_ms, rel_err

from kvrunner.layers.fused.dispatch import use_skinny_gemm
from kvrunner.layers.fused.silu_mul_triton import silu_mul_triton
from kvrunner.layers.fused.skinny_gemm_triton import (
    SkinnyLaunch,
    choose_splits,
    default_launch,
    skinny_gemm,
)

#: (model, projection, N, K) of one layer at tensor-parallel size 1
SHAPES = [
    ("0.6B", "qkv", 4096, 1024), ("0.6B", "o", 1024, 2048),
    ("0.6B", "gate_up", 6144, 1024), ("0.6B", "down", 1024, 3072),
    ("8B", "qkv", 6144, 4096), ("8B", "o", 4096, 4096),
    ("8B", "gate_up", 24576, 4096), ("8B", "down", 4096, 12288),
    ("0.6B", "lm_head", 151936, 1024),
]  # fmt: skip
ROWS = (1, 8, 64)
CALLS = 20


def graph_us(fn, xs: list[torch.Tensor], ws: list[torch.Tensor]) -> float:
    """µs per call of ``fn`` replayed from a CUDA graph of one call per weight."""
    for x, w in zip(xs, ws, strict=True):
        fn(x, w)  # compile, settle workspaces
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for x, w in zip(xs, ws, strict=True):
            fn(x, w)
    return median_ms(graph.replay) * 1e3 / len(xs)


def candidates(m: int, n: int, k: int) -> list[SkinnyLaunch]:
    """The launches ``--sweep`` times: tensor-core tiles for any M, GEMV tiles for one
    row; each once with K split to fill the machine and once unsplit."""
    tiles = [(64, 128), (32, 128), (16, 256), (32, 256)]
    gemv = [(8, 512), (8, 1024), (16, 256), (16, 512), (4, 1024)] if m == 1 else []
    out = []
    for (bn, bk), one_row in [(t, False) for t in tiles] + [(t, True) for t in gemv]:
        for splits in {choose_splits(n, k, bn, bk), 1}:
            out.append(SkinnyLaunch(bn, bk, splits, one_row))
    return out


def describe(launch: SkinnyLaunch) -> str:
    kind = "gemv" if launch.gemv else "dot"
    return f"{kind} {launch.block_n}x{launch.block_k}/{launch.splits}"


def sweep_line(xs: list[torch.Tensor], ws: list[torch.Tensor], blas: float,
               ref: torch.Tensor) -> str:
    """The fastest candidate launch against cuBLAS, with its error."""
    m, k = xs[0].shape
    n = ws[0].shape[0]
    timed = []
    for launch in candidates(m, n, k):
        timed.append((graph_us(lambda x, w, lc=launch: skinny_gemm(x, w, lc), xs, ws), launch))
    best_us, best = min(timed, key=lambda t: t[0])
    err = rel_err(skinny_gemm(xs[0], ws[0], best), ref)
    return (f"    sweep: best {describe(best)} {best_us:.2f} us ({best_us / blas:.2f}x cuBLAS, "
            f"err {err:.1e})")


#: (model, N, K) of the down projections the --swiglu table times
SWIGLU = [("0.6B", 1024, 3072), ("8B", 4096, 12288)]
SWIGLU_ROWS = (1, 8, 16, 32, 64)


def swiglu_table(bw: float) -> None:
    """Activation + cuBLAS against the fused skinny launch, per down projection and M."""
    print(f"{'model':>5} {'M':>3} {'act + cuBLAS us':>15} {'fused us':>9} {'floor us':>8} "
          f"{'fused/cuBLAS':>12} {'err fused':>9}")
    for model, n, k in SWIGLU:
        g = torch.Generator(device="cuda").manual_seed(n + k)
        ws = [torch.randn(n, k, device="cuda", generator=g).to(torch.bfloat16) * 0.02
              for _ in range(CALLS)]
        for m in SWIGLU_ROWS:
            xs = [(3 * torch.randn(m, 2 * k, device="cuda", generator=g)).to(torch.bfloat16)
                  for _ in range(CALLS)]
            gate, up = xs[0].float().chunk(2, dim=-1)
            ref = (torch.nn.functional.silu(gate) * up) @ ws[0].float().T
            apart = graph_us(lambda x, w: F.linear(silu_mul_triton(x), w), xs, ws)
            fused = graph_us(lambda x, w: skinny_gemm(x, w, silu_mul=True), xs, ws)
            floor = (n * k * 2 + m * (2 * k + n) * 2) / (bw * 1e12) * 1e6
            err = rel_err(skinny_gemm(xs[0], ws[0], silu_mul=True), ref)
            picked = use_skinny_gemm(xs[0], ws[0])  # what project_silu_mul dispatches
            print(f"{model:>5} {m:>3} {apart:>15.2f} {fused:>9.2f} {floor:>8.2f} "
                  f"{fused / apart:>12.2f} {err:>9.1e}{'  auto' if picked else ''}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sweep", action="store_true", help="time every candidate launch too")
    ap.add_argument("--swiglu", action="store_true",
                    help="only the down projections with the activation fused in")
    args = ap.parse_args()
    bw = copy_bandwidth_tbps()
    if args.swiglu:
        swiglu_table(bw)
        return
    print(f"copy bandwidth {bw:.2f} TB/s; {CALLS} calls per graph on distinct weights "
          "(4 for the lm_head)")
    print(f"{'model':>5} {'proj':>7} {'M':>3} {'splits':>6} {'cuBLAS us':>9} {'ours us':>8} "
          f"{'floor us':>8} {'ours/cuBLAS':>11} {'ours TB/s':>9} {'err cuBLAS':>10} "
          f"{'err ours':>9}")
    worse, auto = 0, []
    for model, proj, n, k in SHAPES:
        g = torch.Generator(device="cuda").manual_seed(n + k)
        calls = CALLS if n * k < 100_000_000 else 4  # four lm_heads already exceed L2
        ws = [torch.randn(n, k, device="cuda", generator=g).to(torch.bfloat16) * 0.02
              for _ in range(calls)]
        for m in ROWS:
            xs = [torch.randn(m, k, device="cuda", generator=g).to(torch.bfloat16)
                  for _ in range(calls)]
            ref = xs[0].float() @ ws[0].float().T
            err_blas = rel_err(F.linear(xs[0], ws[0]), ref)
            err_ours = rel_err(skinny_gemm(xs[0], ws[0]), ref)
            blas = graph_us(F.linear, xs, ws)
            ours = graph_us(skinny_gemm, xs, ws)
            nbytes = n * k * 2 + m * (n + k) * 2
            floor = nbytes / (bw * 1e12) * 1e6
            worse += ours > blas
            picked = use_skinny_gemm(xs[0], ws[0])  # what the projections dispatch
            if picked:
                auto.append(ours / blas)
            print(f"{model:>5} {proj:>7} {m:>3} {default_launch(m, n, k).splits:>6} {blas:>9.2f} "
                  f"{ours:>8.2f} {floor:>8.2f} {ours / blas:>11.2f} "
                  f"{nbytes / (ours * 1e-6) / 1e12:>9.2f} {err_blas:>10.1e} {err_ours:>9.1e}"
                  f"{'  auto' if picked else ''}")
            if args.sweep:
                print(sweep_line(xs, ws, blas, ref))
    dispatched = f"ours/cuBLAS {min(auto):.2f}-{max(auto):.2f}" if auto else "none"
    print(f"ours slower than cuBLAS in {worse} of {len(SHAPES) * len(ROWS)} cases; "
          f"the {len(auto)} cases dispatched here: {dispatched}")


if __name__ == "__main__":
    main()
