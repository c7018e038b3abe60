"""Paged decode attention vs torch SDPA on the same data laid out contiguously.

bf16, Hq 32, Hkv 8, D 128. Paged KV: block size 16, block tables drawn from a
shuffled pool, so every sequence's blocks are scattered. Prints time, the ratio
to SDPA and achieved TB/s against the measured copy bandwidth.

A second table times the small batches of a decode step as the engine runs them:
captured in a CUDA graph (20 calls, each over its own sequences' blocks, so the KV is
read from HBM, not L2), splits chosen by ``choose_num_splits`` for an engine's
``max_model_len`` against one unsplit pass.

A third times one layer's decode KV write plus attention, graphed the same way: a
``store_kv`` launch then the decode launch, against the one decode launch that stores
the step's keys and values itself (``new_kv``, what the paged layer runs).

With ``--kv-cache-dtype fp8`` it times FP8 KV instead (``kv_cache_dtype = "fp8"``):
the tokens a pool of the same bytes holds, and one layer's decode step at batch 256
(the launch that stores the step's keys and values and attends, as the layer runs it)
over a bf16 pool against an e4m3 one holding the same sequences, each under its
default launch and others (:data:`FP8_LAUNCHES`: warps, keys a tile, how deep the walk
over whole tiles is pipelined, ``f16``: e4m3 widened to float16, not the queries'
bfloat16), each with its output's largest distance from the pool's default launch's.

    python benchmarks/bench_decode_attention.py [--kv-cache-dtype fp8]
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

import attrs
import torch
import torch.nn.functional as F
from common import copy_bandwidth_tbps, median_ms, rel_err

from kvrunner_paged.kv_format import FP8_DTYPE
from kvrunner_paged.ops.paged_attention.decode import (
    choose_num_splits,
    decode_launch,
    paged_decode_attention,
)
from kvrunner_paged.ops.paged_attention.inputs import NewKV, PagedAttentionInputs
from kvrunner_paged.ops.store_kv.store import store_kv

HQ, HKV, D, BLOCK = 32, 8, 128, 16
CASES = [(64, 4096, 1.10), (256, 1024, 1.10), (8, 32768, 1.20)]
#: (batch, context, the engine's max_model_len) of the small-batch table
SMALL = [(1, 256, 400), (1, 256, 4096), (1, 2048, 4096), (4, 1024, 4096), (8, 512, 4096)]
CALLS = 20
#: (batch, context) of the store-then-attend table: the end-to-end bench's decode batches
STORE = [(1, 256), (64, 256), (256, 256)]
#: (batch, context) of the FP8 KV table: RL decode batches, a prompt of 1,024 and more
FP8_CASES = [(256, 1024), (256, 2048)]


def paged_pool(seqs: int, ctx: int, g: torch.Generator) -> tuple[torch.Tensor, ...]:
    """A shuffled paged pool holding ``seqs`` sequences of ``ctx`` random keys/values."""
    blocks_per_seq = ctx // BLOCK
    num_blocks = seqs * blocks_per_seq
    tables = torch.randperm(num_blocks, device="cuda", generator=g).view(seqs, -1)
    k_cache, v_cache = (torch.randn(num_blocks, BLOCK, HKV, D, device="cuda", generator=g,
                                    dtype=torch.bfloat16) for _ in range(2))
    return tables.to(torch.int32), k_cache, v_cache


def graphed_us(calls: Callable[[], None]) -> float:
    """µs per call of ``calls`` (``CALLS`` launches) captured once and replayed."""
    calls()  # compile
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        calls()
    return median_ms(graph.replay) * 1e3 / CALLS


def small_batch_us(batch: int, ctx: int, splits: int) -> float:
    """µs per call of one decode launch replayed from a graph of ``CALLS`` calls."""
    g = torch.Generator(device="cuda").manual_seed(batch + ctx)
    tables, k_cache, v_cache = paged_pool(batch * CALLS, ctx, g)
    lens = torch.full((batch,), ctx, dtype=torch.int32, device="cuda")
    q = torch.randn(CALLS, batch, HQ, D, device="cuda", generator=g, dtype=torch.bfloat16)
    out = torch.empty_like(q)
    inputs = [PagedAttentionInputs(q=q[i], k_cache=k_cache, v_cache=v_cache,
                                   block_tables=tables[i * batch:(i + 1) * batch],
                                   context_lens=lens, scale=D**-0.5) for i in range(CALLS)]

    def calls() -> None:
        for i in range(CALLS):
            paged_decode_attention(inputs=inputs[i], num_splits=splits, out=out[i])

    return graphed_us(calls)


def small_batches(num_sms: int) -> None:
    print(f"{'case':>22} {'splits':>6} {'split us':>9} {'unsplit us':>11} {'ratio':>6}")
    for batch, ctx, max_len in SMALL:
        splits = choose_num_splits(batch, HKV, max_len, num_sms)
        split = small_batch_us(batch, ctx, splits)
        unsplit = small_batch_us(batch, ctx, 1)
        print(f"{f'B{batch} ctx{ctx} max_len{max_len}':>22} {splits:>6} {split:>9.2f} "
              f"{unsplit:>11.2f} {split / unsplit:>6.2f}")


def store_and_attend_us(batch: int, ctx: int, fused: bool, num_sms: int) -> float:
    """µs per layer of writing this step's KV and attending, replayed from a graph of
    ``CALLS`` layers (each over its own sequences' blocks and its own slots)."""
    g = torch.Generator(device="cuda").manual_seed(batch + ctx)
    tables, k_cache, v_cache = paged_pool(batch * CALLS, ctx, g)
    lens = torch.full((batch,), ctx, dtype=torch.int32, device="cuda")
    # each row's newest position (ctx - 1) is the last slot of its last block
    slots = (tables[:, -1].long() * BLOCK + (ctx - 1) % BLOCK).view(CALLS, batch)
    q = torch.randn(CALLS, batch, HQ, D, device="cuda", generator=g, dtype=torch.bfloat16)
    kv = torch.randn(CALLS, batch, 2 * HKV, D, device="cuda", generator=g, dtype=torch.bfloat16)
    out = torch.empty_like(q)
    splits = choose_num_splits(batch, HKV, 4096, num_sms)

    def calls() -> None:
        for i in range(CALLS):
            k, v = kv[i, :, :HKV], kv[i, :, HKV:]
            inputs = PagedAttentionInputs(q=q[i], k_cache=k_cache, v_cache=v_cache,
                                          block_tables=tables[i * batch:(i + 1) * batch],
                                          context_lens=lens, scale=D**-0.5)
            if fused:
                inputs = attrs.evolve(inputs, new_kv=NewKV(k=k, v=v, slot_mapping=slots[i]))
            else:
                store_kv(k=k, v=v, k_cache=k_cache, v_cache=v_cache, slot_mapping=slots[i])
            paged_decode_attention(inputs=inputs, num_splits=splits, out=out[i])

    return graphed_us(calls)


def store_then_attend(num_sms: int) -> None:
    print(f"{'case':>14} {'store + attend us':>18} {'fused us':>9} {'saved us':>9}")
    for batch, ctx in STORE:
        apart = store_and_attend_us(batch, ctx, False, num_sms)
        fused = store_and_attend_us(batch, ctx, True, num_sms)
        print(f"{f'B{batch} ctx{ctx}':>14} {apart:>18.2f} {fused:>9.2f} {apart - fused:>9.2f}")


def run_case(batch: int, ctx: int, num_sms: int) -> dict:
    g = torch.Generator(device="cuda").manual_seed(batch * 7 + ctx)
    dt = torch.bfloat16
    q = torch.randn(batch, HQ, D, device="cuda", dtype=dt, generator=g)
    k = torch.randn(batch, HKV, ctx, D, device="cuda", dtype=dt, generator=g)
    v = torch.randn(batch, HKV, ctx, D, device="cuda", dtype=dt, generator=g)
    blocks_per_seq = ctx // BLOCK
    num_blocks = batch * blocks_per_seq
    perm = torch.randperm(num_blocks, device="cuda", generator=g)
    tables = perm.view(batch, blocks_per_seq).to(torch.int32)
    k_cache = torch.empty(num_blocks, BLOCK, HKV, D, device="cuda", dtype=dt)
    v_cache = torch.empty_like(k_cache)
    # scatter the contiguous KV into the paged pool: [B, Hkv, ctx, D] -> blocks
    k_blocks = k.permute(0, 2, 1, 3).reshape(batch, blocks_per_seq, BLOCK, HKV, D)
    v_blocks = v.permute(0, 2, 1, 3).reshape(batch, blocks_per_seq, BLOCK, HKV, D)
    k_cache[tables.long()] = k_blocks
    v_cache[tables.long()] = v_blocks
    lens = torch.full((batch,), ctx, dtype=torch.int32, device="cuda")
    scale = D**-0.5
    splits = choose_num_splits(batch, HKV, ctx, num_sms)
    out = torch.empty_like(q)
    inputs = PagedAttentionInputs(q=q, k_cache=k_cache, v_cache=v_cache, block_tables=tables,
                                  context_lens=lens, scale=scale)

    def ours() -> torch.Tensor:
        return paged_decode_attention(inputs=inputs, num_splits=splits, out=out)

    def sdpa() -> torch.Tensor:
        return F.scaled_dot_product_attention(q.unsqueeze(2), k, v, scale=scale, enable_gqa=True)

    err = rel_err(ours(), sdpa().squeeze(2))
    t_ours, t_sdpa = median_ms(ours), median_ms(sdpa)
    nbytes = 2 * k.numel() * k.element_size() + 2 * q.numel() * q.element_size()
    return dict(
        batch=batch,
        ctx=ctx,
        splits=splits,
        ours_us=t_ours * 1e3,
        sdpa_us=t_sdpa * 1e3,
        ratio=t_ours / t_sdpa,
        ours_tbps=nbytes / (t_ours * 1e-3) / 1e12,
        sdpa_tbps=nbytes / (t_sdpa * 1e-3) / 1e12,
        rel_err=err,
    )


def decode_step_us(batch: int, ctx: int, kv_dtype: torch.dtype, num_sms: int,
                   **launch: Any) -> tuple[float, torch.Tensor]:
    """µs of one layer's decode launch that stores and attends, and its output, over a
    pool in ``kv_dtype`` (the bf16 pool's values, quantized at scale 1.0 for e4m3), with
    ``launch`` passed to :func:`paged_decode_attention` (``block_n``, ``num_warps``,
    ``num_stages``, ``widen_f16``)."""
    g = torch.Generator(device="cuda").manual_seed(batch + ctx)
    tables, k_cache, v_cache = paged_pool(batch, ctx, g)
    k_cache, v_cache = k_cache.to(kv_dtype), v_cache.to(kv_dtype)
    lens = torch.full((batch,), ctx, dtype=torch.int32, device="cuda")
    q = torch.randn(batch, HQ, D, device="cuda", generator=g, dtype=torch.bfloat16)
    kv = torch.randn(batch, 2 * HKV, D, device="cuda", generator=g, dtype=torch.bfloat16)
    slots = (tables[:, -1].long() * BLOCK + BLOCK - 1).contiguous()
    inputs = PagedAttentionInputs(
        q=q, k_cache=k_cache, v_cache=v_cache, block_tables=tables, context_lens=lens,
        scale=D**-0.5, new_kv=NewKV(k=kv[:, :HKV], v=kv[:, HKV:], slot_mapping=slots),
    )  # fmt: skip
    splits = choose_num_splits(batch, HKV, ctx, num_sms)
    out = paged_decode_attention(inputs=inputs, num_splits=splits, **launch)
    us = median_ms(lambda: paged_decode_attention(inputs=inputs, num_splits=splits,
                                                  **launch)) * 1e3
    return us, out


#: the launches of the FP8 KV table: (pool dtype, launch); the first two are the
#: defaults (``decode_launch``)
FP8_LAUNCHES: list[tuple[torch.dtype, dict[str, int | bool]]] = [
    (torch.bfloat16, {}),
    (FP8_DTYPE, {}),
    (FP8_DTYPE, {"block_n": 128, "widen_f16": True}),
    (FP8_DTYPE, {"block_n": 128}),
    (FP8_DTYPE, {"widen_f16": True}),
    (FP8_DTYPE, {"num_stages": 1}),
    (FP8_DTYPE, {"num_stages": 3}),
    (FP8_DTYPE, {"block_n": 128, "widen_f16": True, "num_stages": 3}),
    (FP8_DTYPE, {"block_n": 128, "widen_f16": True, "num_warps": 8}),
    (FP8_DTYPE, {"block_n": 256, "widen_f16": True, "num_warps": 8}),
]


def launch_label(dtype: torch.dtype, launch: dict[str, int | bool]) -> str:
    """``pool, keys a tile, warps, stages[, f16]`` of a launch (the table's launch
    column), the defaults filled in from :func:`decode_launch`."""
    warps, stages = decode_launch(torch.empty(0, dtype=dtype))
    return (f"{'fp8' if dtype == FP8_DTYPE else 'bf16'}, {launch.get('block_n', 64)}, "
            f"{launch.get('num_warps', warps)}, {launch.get('num_stages', stages)}"
            + (", f16" if launch.get("widen_f16") else "")
            + (" (default)" if not launch else ""))


def fp8_kv(num_sms: int) -> None:
    """Tokens per GiB of one layer's pool, and the decode step at batch 256 over a bf16
    and an e4m3 pool under each launch of :data:`FP8_LAUNCHES` (µs and KV TB/s)."""
    per_token = {dt: 2 * HKV * D * torch.empty((), dtype=dt).element_size()
                 for dt in (torch.bfloat16, FP8_DTYPE)}  # fmt: skip
    tokens = {dt: (1 << 30) // size for dt, size in per_token.items()}
    print(f"\nFP8 KV: tokens per GiB of one layer's pool: bf16 {tokens[torch.bfloat16]}, "
          f"fp8 {tokens[FP8_DTYPE]}")  # fmt: skip
    print(f"{'pool, keys, warps, stages':>28}" + "".join(f"{f'B{b} ctx{c} us':>16} {'TB/s':>6}"
                                       for b, c in FP8_CASES) + f"{'max |diff|':>12}")
    first: dict[torch.dtype, torch.Tensor] = {}
    for dtype, launch in FP8_LAUNCHES:
        cells = []
        for i, (batch, ctx) in enumerate(FP8_CASES):
            t, out = decode_step_us(batch, ctx, dtype, num_sms, **launch)
            cells.append(f"{t:>16.1f} {batch * ctx * per_token[dtype] / (t * 1e-6) / 1e12:>6.2f}")
            if i == 0:  # the output of the first case against the pool's default launch's
                diff = (out.float() - first.setdefault(dtype, out).float()).abs().max()
        print(f"{launch_label(dtype, launch):>28}" + "".join(cells) + f"{diff:>12.2e}",
              flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--kv-cache-dtype", choices=("auto", "fp8"), default="auto",
                        help="fp8: the FP8 KV table (bf16 pools against e4m3 ones) alone")
    args = parser.parse_args()
    props = torch.cuda.get_device_properties(0)
    if args.kv_cache_dtype == "fp8":
        fp8_kv(props.multi_processor_count)
        return
    bw = copy_bandwidth_tbps()
    print(f"{props.name}, {props.multi_processor_count} SMs, copy bandwidth {bw:.2f} TB/s")
    print(
        f"{'case':>14} {'splits':>6} {'ours us':>9} {'SDPA us':>9} {'ratio':>6} {'target':>7} "
        f"{'ours TB/s':>10} {'% copy':>7} {'SDPA TB/s':>10} {'rel err':>8}"
    )
    for batch, ctx, target in CASES:
        r = run_case(batch, ctx, props.multi_processor_count)
        met = "met" if r["ratio"] <= target else "MISSED"
        print(
            f"{f'B{batch} ctx{ctx}':>14} {r['splits']:>6} "
            f"{r['ours_us']:>9.1f} {r['sdpa_us']:>9.1f} "
            f"{r['ratio']:>6.2f} {f'<={target:.2f}':>7} {r['ours_tbps']:>10.2f} "
            f"{100 * r['ours_tbps'] / bw:>6.0f}% {r['sdpa_tbps']:>10.2f} "
            f"{r['rel_err']:>8.1e}  {met}"
        )
    small_batches(props.multi_processor_count)
    store_then_attend(props.multi_processor_count)


if __name__ == "__main__":
    main()
