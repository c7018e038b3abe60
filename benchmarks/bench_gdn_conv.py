"""The GDN layer's prefill conv (causal depthwise conv1d + SiLU, state write-back) against
its byte floor and fla's ``causal_conv1d``, same data, same run.

Qwen3-Next-80B-A3B's conv: 8,192 channels (q, k, v of 16 / 16 / 32 heads of 128),
kernel 4, bf16. Two steps: one fresh sequence of T = 4,096, and four sequences of
1,024 continuing from pool history. Every call is timed in a CUDA graph (GPU time: the
host is out of the window). The floor is the input read plus the output written, over
the measured copy bandwidth. Rows: our default tile, each candidate tile (``--sweep``,
fresh step only: tokens x channels x warps, and the program order, ``channels_fastest``),
q/k/v written as three dense sections (the layer's fla path), fla's call (with its own
final-state launch, as ours writes the pool).

    python benchmarks/bench_gdn_conv.py [--sweep]
"""

from __future__ import annotations

import argparse
import itertools

import attrs
import torch
from common import copy_bandwidth_tbps, graph_ms, rel_err

from kvrunner_gdn.ops.short_conv.inputs import ShortConvInputs
from kvrunner_gdn.ops.short_conv.prefill import (
    default_conv_tiles,
    short_conv_prefill,
    short_conv_prefill_split,
)
from kvrunner_gdn.state import STATE_DTYPE

SECTIONS, WIDTH = (2048, 2048, 4096), 4
DIM = sum(SECTIONS)
# 8 warps was the slowest choice of nearly every tile in the first sweeps (H200)
SWEEP_T, SWEEP_D, SWEEP_WARPS = (8, 16, 32, 64), (32, 64, 128, 256), (1, 2, 4)


def fla_conv():
    """fla's ``causal_conv1d`` and its chunk map builder, or None where fla is absent."""
    try:
        from fla.modules.causal_conv1d.ops import causal_conv1d
        from fla.ops.utils.index import prepare_chunk_indices
    except ImportError:
        return None
    return causal_conv1d, prepare_chunk_indices


def one_step(name: str, lens: list[int], history: bool, sweep: bool, bw: float) -> None:
    gen = torch.Generator(device="cuda").manual_seed(len(lens))
    tokens, seqs = sum(lens), len(lens)
    x = torch.randn(tokens, DIM, device="cuda", generator=gen).to(torch.bfloat16)
    weight = (torch.randn(DIM, WIDTH, device="cuda", generator=gen) * 0.3).to(torch.bfloat16)
    pool = torch.randn(2 * seqs, DIM, WIDTH - 1, device="cuda", generator=gen).to(STATE_DTYPE)
    cu = torch.tensor([0, *itertools.accumulate(lens)], dtype=torch.int32, device="cuda")
    read = torch.arange(seqs, dtype=torch.int32, device="cuda") if history else -torch.ones(
        seqs, dtype=torch.int32, device="cuda")
    write = torch.arange(seqs, 2 * seqs, dtype=torch.int32, device="cuda")
    conv = ShortConvInputs(x=x, conv_state=pool, weight=weight, read_indices=read,
                           write_indices=write, cu_seqlens=cu, max_seqlen=max(lens))
    known = attrs.evolve(conv, total_tokens=tokens)  # the host knows every row is written
    floor_us = 2 * x.numel() * x.element_size() / (bw * 1e12) * 1e6
    print(f"== {name}: {seqs} x {lens[0]} tokens, {DIM} channels; floor {floor_us:.1f} us")

    def row(label: str, fn) -> float:
        fn()  # compiles (and autotunes) before the graph is captured
        us = graph_ms(fn) * 1e3
        print(f"  {label:<44} {us:8.1f} us  {us / floor_us:5.2f}x floor")
        return us

    want = short_conv_prefill(inputs=conv).float()
    ours = row(f"ours, default tile {default_conv_tiles(DIM, max(lens))}",
               lambda: short_conv_prefill(inputs=known))
    cut = torch.cat(short_conv_prefill_split(inputs=known, sections=SECTIONS), 1)
    row("ours, q/k/v as three sections",
        lambda: short_conv_prefill_split(inputs=known, sections=SECTIONS))
    print(f"  sections equal the whole output: {torch.equal(cut.float(), want)}")
    if sweep:
        differ = []
        for tiles in itertools.product(SWEEP_T, SWEEP_D, SWEEP_WARPS, (False, True)):
            if tiles[0] * tiles[1] > 2048 * tiles[2]:
                continue  # over 64 fp32 accumulators a thread: spills (measured 12-16x slower)
            fn = lambda t=tiles: short_conv_prefill(inputs=known, tiles=t)
            if not torch.equal(fn().float(), want):
                differ.append(tiles)
            row(f"  tile {tiles}", fn)
        print(f"  every tile's output equals the default's bit for bit: {not differ} {differ}")
    fla = fla_conv()
    if fla is None:
        print("  fla unavailable: no peer row")
        return
    causal_conv1d, prepare_chunk_indices = fla
    cu_long = cu.long()
    cu_cpu = cu_long.cpu()  # made here: a graph capture allows no copy to the host
    chunks = prepare_chunk_indices(cu_long, 64, cu_seqlens_cpu=cu_cpu)
    # fla keeps the whole window (kernel width) per sequence, as its own layout
    initial = torch.randn(seqs, DIM, WIDTH, device="cuda", generator=gen).to(x.dtype) \
        if history else None

    def peer() -> torch.Tensor:
        y, _ = causal_conv1d(x[None], weight, activation="silu", initial_state=initial,
                             output_final_state=True, cu_seqlens=cu_long,
                             cu_seqlens_cpu=cu_cpu, chunk_indices=chunks)
        return y

    if not history:
        print(f"  fla's output against ours: rel err {rel_err(peer()[0].float(), want):.1e}")
    theirs = row("fla causal_conv1d (+ its final state)", peer)
    print(f"  ours / fla: {ours / theirs:.2f}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sweep", action="store_true", help="time every candidate tile too")
    args = ap.parse_args()
    bw = copy_bandwidth_tbps()
    print(f"copy bandwidth {bw:.2f} TB/s")
    with torch.inference_mode():
        one_step("fresh sequence", [4096], False, args.sweep, bw)
        # Not swept: the two steps ranked the tiles alike (the first sweeps, H200).
        one_step("continuing sequences", [1024] * 4, True, False, bw)


if __name__ == "__main__":
    main()
