"""Deterministic mode's two kernels on the Qwen3-0.6B shape (H200, bf16): launch
candidates timed, and which of them give the same bits.

**Invariant GEMM** (``layers/fused/invariant_gemm_triton.py``). Per projection (fused
QKV, o_proj, fused gate/up, down, lm_head) and row count: cuBLAS, the default launch
(:func:`invariant_launch`) and candidate launches, each in a CUDA graph of calls on
distinct weights (the weights are read from HBM, as in a decode step). Every
candidate's output at every row count is compared bit for bit with the default
launch's, or, for a candidate of another reduction, with the first launch timed with
that reduction: ``same`` marks launches that share those bits, so any of them may serve
any row count.

**Fixed-order attention** (``ops/paged_attention/fixed_order.py``, deterministic mode's
attention for every token). Candidate launches ``block_m/block_n/warps/stages`` timed in
the walk layout on decode steps (batch 1, 64, 256 at contexts of 384 and 1,280; batch 1
and 8 at 8,192) and on a prefill of 16 x 1,024, beside the default mode's kernels (the
split-KV decode kernel, the prefill launch), and the mode's launch in the split-programs
layout on the decode steps. Then whether the two layouts give decode rows the same bits,
and, for each candidate run on decode rows, the candidates whose prefill gives those
rows the same bits (a whole prompt and a chunk after a cached prefix, across a split's
end): deterministic mode may attend decode rows with one launch and prompts with another
only where they agree.

    python benchmarks/bench_invariant_kernels.py [--gemm-only | --gemm-defaults | --gemm-slices
                                                  | --attention-only]
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

import torch
import torch.nn.functional as F
import triton
import triton.testing

from kvrunner.layers.fused.invariant_gemm_triton import (
    InvariantLaunch,
    invariant_gemm,
    invariant_launch,
    invariant_reduction,
    slice_depth,
)
from kvrunner.layers.linear import project
from kvrunner_paged.ops.paged_attention.decode import choose_num_splits, paged_decode_attention
from kvrunner_paged.ops.paged_attention.fixed_order import (
    KEY_SPLIT,
    fixed_order_attention,
    use_split_programs,
)
from kvrunner_paged.ops.paged_attention.inputs import PagedAttentionInputs
from kvrunner_paged.ops.paged_attention.prefill import PrefillLaunch, paged_prefill_attention

#: (projection, N, K) of one Qwen3-0.6B layer, and its LM head
GEMM_SHAPES = [("qkv", 4096, 1024), ("o", 1024, 2048), ("gate_up", 6144, 1024),
               ("down", 1024, 3072), ("lm_head", 151936, 1024)]
GEMM_ROWS = (1, 64, 256, 2048)
CALLS = 8
#: layouts ``(block_m, block_n, warps, stages)`` timed with the default reduction
LAYOUTS = [(64, 64, 4, 3), (64, 64, 4, 4), (64, 128, 4, 3), (64, 128, 4, 4), (64, 256, 8, 3),
           (128, 64, 4, 3), (128, 128, 8, 3), (128, 128, 8, 4), (128, 256, 8, 3),
           (64, 32, 4, 3), (16, 64, 4, 3)]

HQ, HKV, D, BLOCK = 16, 8, 128, 16
DECODE = [(1, 384), (64, 384), (256, 384), (1, 1280), (64, 1280), (256, 1280), (1, 8192),
          (8, 8192)]
PREFILL_SEQS, PREFILL_LEN = 16, 1024
#: the engine's longest context in the timed cases (sizes the split programs' grid)
MAX_CONTEXT = 8192 + 16
#: attention launches ``(block_m, block_n, warps, stages)``; the third is the one
#: deterministic mode runs for every bf16 step (``fixed_order.LAUNCH``), the last the
#: prefill kernel's own
ATTENTION = [(16, 64, 4, 3), (16, 64, 4, 1), (16, 64, 4, 2), (16, 64, 2, 1), (16, 64, 2, 2),
             (16, 32, 4, 3), (16, 128, 4, 2), (16, 128, 2, 1), (32, 64, 4, 3), (64, 64, 4, 3),
             (64, 64, 4, 2), (64, 128, 4, 2), (64, 32, 4, 3), (128, 64, 8, 2), (128, 64, 8, 3)]


def graphed_us(fn: Callable[[int], object], calls: int) -> float:
    """µs per call of ``fn(i)``, ``i < calls``, captured back to back in one graph."""
    for i in range(calls):
        fn(i)  # compile, settle workspaces
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(calls):
            fn(i)
    ms = triton.testing.do_bench(graph.replay, warmup=20, rep=100, return_mode="median")
    return ms * 1e3 / calls


def describe(launch: InvariantLaunch) -> str:
    walk = ("walk" if launch.in_program
            else "slices" if launch.last_program_sums else "slices+sum kernel")
    return (f"k{launch.block_k}x{launch.splits} {launch.block_m}x{launch.block_n} "
            f"w{launch.num_warps} s{launch.num_stages} {walk}")


def whole_slices(k: int, splits: int, block_k: int) -> bool:
    """Whether K cut into ``splits`` slices of whole steps leaves none empty (a
    reduction :func:`invariant_gemm` takes)."""
    return triton.cdiv(k, slice_depth(k, splits, block_k)) == splits


def gemm_candidates(n: int, k: int) -> list[InvariantLaunch]:
    """Layouts of the default reduction, each with its slices in programs of their own
    and walked in one; then other reductions (deeper steps, no slicing)."""
    block_k, splits = invariant_reduction(n, k)
    out = []
    for bm, bn, warps, stages in LAYOUTS:
        for walk in ((False, True) if splits > 1 else (True,)):
            out.append(InvariantLaunch(block_k, splits, bm, bn, warps, stages, walk))
            if not walk:  # the slices added by a second kernel, not the tile's last program
                out.append(InvariantLaunch(block_k, splits, bm, bn, warps, stages, walk,
                                           last_program_sums=False))
    for reduction in ((128, splits), (64, 1), (128, 1)):
        for bm, bn, warps, stages in ((64, 64, 4, 3), (64, 128, 4, 3), (128, 128, 8, 3)):
            out.append(InvariantLaunch(*reduction, bm, bn, warps, stages, True))
    # more, shallower slices (a decode step's programs): each slice still whole steps
    for more in (2 * splits, 4 * splits):
        if whole_slices(k, more, block_k):
            for stages in (2, 3):
                out.append(InvariantLaunch(block_k, more, 64, 64, 4, stages, False))
    return list(dict.fromkeys(out))


def slice_candidates(n: int, k: int) -> list[InvariantLaunch]:
    """Reductions of 2, 4 and 8 times the default's slices (each still whole steps;
    another reduction, so other bits, which the mode may take for every row count
    alike), each in a program per slice at 2 to 4 stages and walked in one program
    (the prefill's layout); and the default reduction in 32-column tiles."""
    block_k, splits = invariant_reduction(n, k)
    out = [InvariantLaunch(block_k, splits, 64, 32, 4, stages, splits == 1)
           for stages in (3, 4)]
    for more in (2 * splits, 4 * splits, 8 * splits):
        if not whole_slices(k, more, block_k):
            continue
        out += [InvariantLaunch(block_k, more, 64, 64, 4, stages, False) for stages in (2, 3, 4)]
        out += [InvariantLaunch(block_k, more, 64, 32, 4, 3, False),
                InvariantLaunch(block_k, more, 64, 64, 4, 3, True),
                InvariantLaunch(block_k, more, 128, 128, 8, 3, True)]
    return out


def gemm_table(candidates: Callable[[int, int], list[InvariantLaunch]] | None) -> None:
    print(f"invariant GEMM, bf16, {CALLS} calls per graph on distinct weights; "
          "'same' = the bits, at every row count, of the first launch timed with its "
          "reduction (the default launch, for the default reduction)")
    for name, n, k in GEMM_SHAPES:
        gemm_shape(name, n, k, candidates)
        torch.cuda.empty_cache()


def gemm_shape(name: str, n: int, k: int,
               candidates: Callable[[int, int], list[InvariantLaunch]] | None) -> None:
    """One projection's lines: cuBLAS, the default mode's product (``project``: the
    skinny GEMM where it serves, else cuBLAS) and the default launch, then each
    candidate."""
    g = torch.Generator(device="cuda").manual_seed(n + k)
    calls = CALLS if name != "lm_head" else 2  # two LM heads already exceed L2
    ws = [(torch.randn(n, k, device="cuda", generator=g) * 0.02).to(torch.bfloat16)
          for _ in range(calls)]
    rows = [r for r in GEMM_ROWS if name != "lm_head" or r <= 256]
    xs = {m: [torch.randn(m, k, device="cuda", generator=g).to(torch.bfloat16)
              for _ in range(calls)] for m in rows}

    def timed(m: int, fn: Callable[..., torch.Tensor]) -> float:
        return graphed_us(lambda i: fn(xs[m][i], ws[i]), calls)

    default = {m: invariant_gemm(xs[m][0], ws[0]) for m in rows}
    reference = {invariant_reduction(n, k): default}
    blas = {m: timed(m, F.linear) for m in rows}
    print(f"{name} N={n} K={k}: " + "  ".join(
        f"M={m} cuBLAS {blas[m]:.1f} default mode {timed(m, project):.1f} invariant "
        f"{timed(m, invariant_gemm):.1f} us ({describe(invariant_launch(m, n, k))})"
        for m in rows))
    for launch in candidates(n, k) if candidates else ():
        outs = {m: invariant_gemm(xs[m][0], ws[0], launch) for m in rows}
        # another reduction's launches are held to the first of them: its slice
        # programs (decode) and its walk (prefill) must agree as the default's do
        first = reference.setdefault((launch.block_k, launch.splits), outs)
        same = all(torch.equal(outs[m], first[m]) for m in rows)
        times = [timed(m, lambda x, w, lc=launch: invariant_gemm(x, w, lc)) for m in rows]
        print(f"  {describe(launch):<32} {'same' if same else 'DIFF':<5}" + "".join(
            f" M={m} {t:7.1f} us ({t / blas[m]:4.2f}x)" for m, t in zip(rows, times, strict=True)))


def paged(seqs: int, ctx: int, g: torch.Generator) -> tuple[torch.Tensor, ...]:
    """A shuffled pool of ``seqs`` sequences of ``ctx`` keys: tables, k, v."""
    per_seq = -(-ctx // BLOCK)
    tables = torch.randperm(seqs * per_seq, device="cuda", generator=g).view(seqs, per_seq)
    k = torch.randn(seqs * per_seq, BLOCK, HKV, D, device="cuda", generator=g).to(torch.bfloat16)
    return tables.to(torch.int32), k, torch.randn_like(k)


def attend(q, k, v, tables, starts, lens, seqs, longest, launch, split=False) -> torch.Tensor:
    """Deterministic mode's attention under ``launch`` in the walk layout, or in the
    split-programs layout (decode rows)."""
    bm, bn, warps, stages = launch
    inputs = PagedAttentionInputs(q=q, k_cache=k, v_cache=v, block_tables=tables,
                                  query_start_loc=starts, context_lens=lens, scale=D**-0.5,
                                  num_seqs=seqs, max_query_len=longest)
    return fixed_order_attention(inputs=inputs, max_context_len=MAX_CONTEXT,
                                 split_programs=split,
                                 launch=PrefillLaunch(bm, bn, warps, stages, "tf32"))


def attention_table() -> None:
    g = torch.Generator(device="cuda").manual_seed(0)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    head = "".join(f"{f'b{b} c{c}':>11}" for b, c in DECODE)
    print(f"fixed-order attention, bf16, Hq {HQ} Hkv {HKV} D {D}, splits of {KEY_SPLIT} keys: "
          f"us per layer (graphs of calls over distinct sequences)\n{'launch':<20}{head}"
          f"{f'prefill {PREFILL_SEQS}x{PREFILL_LEN}':>20}")
    cases = []
    for batch, ctx in DECODE:
        pools = [paged(batch, ctx, g) for _ in range(4 if batch * ctx < 2**20 else 2)]
        q = torch.randn(batch, HQ, D, device="cuda", generator=g).to(torch.bfloat16)
        starts = torch.arange(batch + 1, device="cuda", dtype=torch.int32)
        lens = torch.full((batch,), ctx, device="cuda", dtype=torch.int32)
        cases.append((pools, q, starts, lens, batch, 1))
    pools = [paged(PREFILL_SEQS, PREFILL_LEN, g) for _ in range(2)]
    q = torch.randn(PREFILL_SEQS * PREFILL_LEN, HQ, D, device="cuda", generator=g)
    starts = torch.arange(PREFILL_SEQS + 1, device="cuda", dtype=torch.int32) * PREFILL_LEN
    lens = torch.full((PREFILL_SEQS,), PREFILL_LEN, device="cuda", dtype=torch.int32)
    cases.append((pools, q.to(torch.bfloat16), starts, lens, PREFILL_SEQS, PREFILL_LEN))

    def timed(case, launch, split=False) -> float:
        pools, q, starts, lens, seqs, longest = case
        return graphed_us(lambda i: attend(q, pools[i][1], pools[i][2], pools[i][0], starts,
                                           lens, seqs, longest, launch, split), len(pools))

    def default(case) -> float:
        pools, q, starts, lens, seqs, longest = case
        inputs = [PagedAttentionInputs(q=q, k_cache=k, v_cache=v, block_tables=tables,
                                       query_start_loc=starts, context_lens=lens, scale=D**-0.5,
                                       num_seqs=seqs, max_query_len=longest)
                  for tables, k, v in pools]
        if longest > 1:
            return graphed_us(lambda i: paged_prefill_attention(inputs=inputs[i]), len(pools))
        splits = choose_num_splits(seqs, HKV, MAX_CONTEXT, sms)
        return graphed_us(lambda i: paged_decode_attention(inputs=inputs[i], num_splits=splits),
                          len(pools))

    def line(label: str, times: list[float | None]) -> None:
        cells = [f"{t:>11.1f}" if t is not None else f"{'-':>11}" for t in times[:-1]]
        last = f"{times[-1]:>20.1f}" if times[-1] is not None else f"{'-':>20}"
        print(f"{label:<20}" + "".join(cells) + last, flush=True)

    line("default mode", [default(c) for c in cases])
    for launch in ATTENTION:
        line("/".join(map(str, launch)), [timed(c, launch) for c in cases])
    line(f"{'/'.join(map(str, ATTENTION[0]))} split", [
        timed(c, ATTENTION[0], split=True) if c[-1] == 1 else None for c in cases])
    chosen = [f"b{b}" for b in sorted({b for b, _ in DECODE})
              if use_split_programs(1, b, HKV, MAX_CONTEXT, sms)]
    print(f"(an engine of max_model_len {MAX_CONTEXT} takes split programs at "
          f"{', '.join(chosen) or 'no batch'} of these)")
    agreement()


def agreement() -> None:
    """Per launch run on decode rows: the launches whose prefill (whole, and a chunk
    after a cached prefix) gives those rows the same bits."""
    g = torch.Generator(device="cuda").manual_seed(1)
    length, cut = KEY_SPLIT + 700, KEY_SPLIT - 20
    tables, k, v = paged(1, length, g)
    q = torch.randn(length, HQ, D, device="cuda", generator=g).to(torch.bfloat16)

    def run(rows: torch.Tensor, prefix: int, launch) -> torch.Tensor:
        starts = torch.tensor([0, len(rows)], device="cuda", dtype=torch.int32)
        lens = torch.tensor([prefix + len(rows)], device="cuda", dtype=torch.int32)
        return attend(rows, k, v, tables, starts, lens, 1, len(rows), launch)

    whole = {lc: run(q, 0, lc) for lc in ATTENTION}
    chunk = {lc: run(q[cut:], cut, lc) for lc in ATTENTION}
    positions = torch.tensor([length - 1, KEY_SPLIT + 1, KEY_SPLIT, KEY_SPLIT - 1, cut, 500, 64,
                              63, 1, 0], device="cuda")
    rows = len(positions)
    starts = torch.arange(rows + 1, device="cuda", dtype=torch.int32)
    lens = (positions + 1).to(torch.int32)
    print("decode rows' bits (positions " + ", ".join(map(str, positions.tolist()))
          + ") against each launch's prefill: whole / chunk after a cached prefix of "
          f"{cut}; walk and split layouts of the decode rows agree: ", end="")
    walked = attend(q[positions], k, v, tables.expand(rows, -1), starts, lens, rows, 1,
                    ATTENTION[0])
    split = attend(q[positions], k, v, tables.expand(rows, -1), starts, lens, rows, 1,
                   ATTENTION[0], split=True)
    print("yes" if torch.equal(walked, split) else "NO")
    for lc in ATTENTION:
        decoded = attend(q[positions], k, v, tables.expand(rows, -1), starts, lens, rows, 1, lc)
        agree = [p for p in ATTENTION if torch.equal(decoded, whole[p][positions])]
        late = positions >= cut
        agree_chunk = [p for p in ATTENTION
                       if torch.equal(decoded[late], chunk[p][positions[late] - cut])]
        print(f"  {'/'.join(map(str, lc)):<14} whole: "
              + (" ".join("/".join(map(str, p)) for p in agree) or "none")
              + "  chunk: " + (" ".join("/".join(map(str, p)) for p in agree_chunk) or "none"))


def main() -> None:
    ap = argparse.ArgumentParser()
    only = ap.add_mutually_exclusive_group()
    only.add_argument("--gemm-only", action="store_true")
    only.add_argument("--attention-only", action="store_true")
    only.add_argument("--gemm-defaults", action="store_true",
                      help="only cuBLAS, the default mode's product and the default "
                           "invariant launch per projection")
    only.add_argument("--gemm-slices", action="store_true",
                      help="the GEMM lines with only the reductions of more, shallower "
                           "slices and 32-column tiles as candidates")
    args = ap.parse_args()
    if not (args.gemm_only or args.gemm_defaults or args.gemm_slices):
        attention_table()
    if not args.attention_only:
        gemm_table(None if args.gemm_defaults
                   else slice_candidates if args.gemm_slices else gemm_candidates)


if __name__ == "__main__":
    main()
