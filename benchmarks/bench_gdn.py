"""Gated-DeltaNet kernels vs flash-linear-attention, same data, same run.

Decode: B64, 32 heads, K = V = 128, fp32 state in a 512-slot pool. Ours reads and
writes the state in place through state indices; fla's
``fused_recurrent_gated_delta_rule`` needs the state gathered out of the pool and
scattered back, which is timed with it (and its kernel alone is shown too).
Prefill: one sequence of T = 4096: our Triton kernel, fla's ``chunk_gated_delta_rule``
alone, and the path the gdn layer dispatches to (``[kernels] gdn_prefill``, default
``auto``: fla through our pool wrapper where fla imports, calling fla's forward
functions directly where that binds; also shown through fla's public call), each with
its ratio to fla.

    python benchmarks/bench_gdn.py             (without fla-core: ours only, no ratios)
    python benchmarks/bench_gdn.py --profile   also: host µs per call (launch only) and
                                               the top GPU kernels of the dispatched
                                               prefill, of fla alone and of fla's varlen
                                               call (the one the wrapper makes)
    --skip-triton-prefill                      leave out our Triton prefill
"""

from __future__ import annotations

import argparse
import functools
from collections.abc import Callable

import torch
from common import copy_bandwidth_tbps, host_us, median_ms, rel_err
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

from kvrunner_gdn.ops.gated_delta_rule.chunk import chunk_gated_delta_rule as ours_chunk
from kvrunner_gdn.ops.gated_delta_rule.chunk_fla import (
    chunk_gated_delta_rule_fla,
    fla_chunk_indices,
    fla_chunk_kernel,
)
from kvrunner_gdn.ops.gated_delta_rule.fla_forward import FlaDirectForward
from kvrunner_gdn.ops.gated_delta_rule.fused_recurrent import (
    fused_recurrent_gated_delta_rule as ours_decode,
)
from kvrunner_gdn.ops.gated_delta_rule.inputs import GatedDeltaRuleInputs
from kvrunner_gdn.prefill_choice import choose_prefill_kernel

B, H, K, V, SLOTS, T = 64, 32, 128, 128, 512, 4096


def inputs(rows: int, seed: int) -> tuple[torch.Tensor, ...]:
    g = torch.Generator(device="cuda").manual_seed(seed)
    q, k = (torch.randn(rows, H, K, device="cuda", dtype=torch.bfloat16, generator=g) for _ in "qk")
    v = torch.randn(rows, H, V, device="cuda", dtype=torch.bfloat16, generator=g)
    decay = -torch.rand(rows, H, device="cuda", generator=g) * 0.1
    beta = torch.rand(rows, H, device="cuda", generator=g).to(torch.bfloat16)
    return q, k, v, decay, beta


def where_the_time_goes(name: str, fn: Callable[[], object], calls: int = 5) -> float:
    """Host time to launch one call (no sync inside), GPU kernel time per call, and the
    kernels that take it: tells host-bound from device-bound."""
    host = host_us(fn, calls)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    # the device's own events (kernels, memcpy/memset), each counted once
    kernels = [e for e in prof.key_averages() if e.device_type == DeviceType.CUDA]
    gpu_us = sum(e.device_time_total for e in kernels) / calls
    print(f"  {name}: host {host:.0f} us to launch a call, GPU kernels {gpu_us:.0f} us a call")
    for e in sorted(kernels, key=lambda e: e.device_time_total, reverse=True)[:8]:
        print(f"    {e.device_time_total / calls:8.1f} us  x{e.count // calls:<3} {e.key[:70]}")
    return gpu_us


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--profile", action="store_true", help="profile the prefill paths too")
    ap.add_argument("--skip-triton-prefill", action="store_true",
                    help="leave out our Triton prefill (its compile takes a minute)")
    args = ap.parse_args()
    bw = copy_bandwidth_tbps()
    scale = K**-0.5
    try:
        from fla.ops.gated_delta_rule import (
            chunk_gated_delta_rule,
            fused_recurrent_gated_delta_rule,
        )
    except Exception as e:  # report ours even where the peer is missing
        print(f"fla unavailable ({e!r}); peer columns empty")
        chunk_gated_delta_rule = fused_recurrent_gated_delta_rule = None

    q, k, v, decay, beta = inputs(B, 0)
    pool = torch.randn(SLOTS, H, K, V, device="cuda") * 0.05
    idx = torch.randperm(SLOTS, device="cuda")[:B].to(torch.int32)
    floor_us = 2 * B * H * K * V * 4 / (bw * 1e12) * 1e6
    pristine = pool.clone()  # both sides start from this state for the comparison
    ours_pool = pristine.clone()
    step = dict(q=q, k=k, v=v, g=decay, beta=beta, read_indices=idx, write_indices=idx,
                scale=scale)
    # ours under their own names: fla's functions of the same names are the peers here
    out_ours = ours_decode(inputs=GatedDeltaRuleInputs(state=ours_pool, **step))
    timed = GatedDeltaRuleInputs(state=pool, **step)
    t_ours = median_ms(lambda: ours_decode(inputs=timed))
    moved = 2 * B * H * K * V * 4
    print(f"copy bandwidth {bw:.2f} TB/s; decode byte floor {floor_us:.0f} us")
    print(
        f"decode ours (in place): {t_ours * 1e3:.0f} us, {moved / (t_ours * 1e-3) / 1e12:.2f} TB/s"
    )
    if fused_recurrent_gated_delta_rule is not None:
        # one token per sequence as fla's [B, 1, ...]; keywords: fla's 5th positional is
        # gk, not beta
        fla_call = functools.partial(
            fused_recurrent_gated_delta_rule, q[:, None], k[:, None], v[:, None],
            g=decay[:, None], beta=beta[:, None], scale=scale, output_final_state=True,
            use_qk_l2norm_in_kernel=True)

        def fla_decode(p: torch.Tensor) -> torch.Tensor:
            o, final = fla_call(initial_state=p[idx.long()])
            p[idx.long()] = final
            return o[:, 0]

        fla_pool = pristine.clone()
        out_fla = fla_decode(fla_pool)
        state0 = pristine[idx.long()]

        def fla_kernel() -> None:
            fla_call(initial_state=state0)

        t_fla, t_fla_k = median_ms(lambda: fla_decode(pool)), median_ms(fla_kernel)
        print(
            f"decode fla gather+kernel+scatter: {t_fla * 1e3:.0f} us "
            f"(kernel alone {t_fla_k * 1e3:.0f} us)"
        )
        print(
            f"decode ratio ours/fla: {t_ours / t_fla:.2f} (target <= 0.35); "
            f"output rel err {rel_err(out_ours.float(), out_fla.float()):.1e}, "
            f"state rel err {rel_err(ours_pool, fla_pool):.1e}"
        )

    prefill(chunk_gated_delta_rule, scale, profiled=args.profile,
            triton_prefill=not args.skip_triton_prefill)
    if chunk_gated_delta_rule is not None:
        varlen_prefill(chunk_gated_delta_rule, scale)


def varlen_prefill(chunk_gated_delta_rule: Callable, scale: float, seqs: int = 4) -> None:
    """T tokens as ``seqs`` fresh sequences (a prefill step of several prompts): fla's
    varlen call with its chunk map given (its cheapest documented form) against the
    layer's path, through fla's public call and through the direct forward."""
    q, k, v, decay, beta = inputs(T, 2)
    state = torch.zeros(seqs, H, K, V, device="cuda")
    cu_host = [T // seqs * i for i in range(seqs + 1)]
    cu = torch.tensor(cu_host, dtype=torch.int32, device="cuda")
    read = torch.full((seqs,), -1, dtype=torch.int32, device="cuda")
    write = torch.arange(seqs, dtype=torch.int32, device="cuda")
    step = GatedDeltaRuleInputs(
        q=q, k=k, v=v, g=decay, beta=beta, state=state, read_indices=read, write_indices=write,
        scale=scale, cu_seqlens=cu, cu_seqlens_host=cu_host,
        host_indices=([-1] * seqs, list(range(seqs))))
    chunks, cu_long = fla_chunk_indices(cu_host, 64, q.device), cu.long()

    def fla_varlen() -> torch.Tensor:
        return chunk_gated_delta_rule(
            q[None], k[None], v[None], decay[None], beta[None], scale=scale,
            output_final_state=True, use_qk_l2norm_in_kernel=True, cu_seqlens=cu_long,
            chunk_indices=chunks)[0][0]  # fmt: skip

    def layer_path(kernel: Callable) -> Callable[[], torch.Tensor]:
        return lambda: chunk_gated_delta_rule_fla(inputs=step, kernel=kernel)

    want, t_fla = fla_varlen(), median_ms(fla_varlen)
    print(f"prefill {seqs} x {T // seqs}: fla varlen call (chunk map given) {t_fla * 1e3:.0f} us")
    bound = fla_chunk_kernel()
    bound_name = "direct forward" if isinstance(bound, FlaDirectForward) else "public call again"
    for name, kernel in (("public call", chunk_gated_delta_rule), (bound_name, bound)):
        run = layer_path(kernel)
        t, err = median_ms(run), rel_err(run().float(), want.float())
        print(f"prefill {seqs} x {T // seqs}: the layer's path, {name}: {t * 1e3:.0f} us, "
              f"{t / t_fla:.2f}x fla's varlen call, rel err {err:.1e}")


def prefill(chunk_gated_delta_rule: Callable | None, scale: float, profiled: bool = False,
            triton_prefill: bool = True) -> None:
    """One sequence of T tokens from a fresh slot: ours (Triton), fla's kernel alone, and
    the path the layer dispatches to (fla through our wrapper where fla imports: the
    same call as ours, state gathered from and scattered into the pool)."""
    q, k, v, decay, beta = inputs(T, 1)
    state = torch.zeros(2, H, K, V, device="cuda")
    cu = torch.tensor([0, T], dtype=torch.int32, device="cuda")
    read = torch.tensor([-1], dtype=torch.int32, device="cuda")
    write = torch.tensor([0], dtype=torch.int32, device="cuda")
    kernel = choose_prefill_kernel(use_triton=True, device=q.device, dtype=q.dtype, head_k_dim=K)
    # bound once, as the layer binds it: fla's forward called directly where it binds
    bound = {"kernel": fla_chunk_kernel()} if kernel == "fla" else {}
    chosen = (functools.partial(chunk_gated_delta_rule_fla, **bound) if kernel == "fla"
              else ours_chunk)
    step = dict(q=q, k=k, v=v, g=decay, beta=beta, state=state, read_indices=read,
                write_indices=write, scale=scale, cu_seqlens=cu, cu_seqlens_host=[0, T])
    ours_step = GatedDeltaRuleInputs(**step)
    # the layer's call: host copies of the offsets, and for fla of the indices too
    layer_step = GatedDeltaRuleInputs(**step, host_indices=([-1], [0]) if kernel == "fla"
                                      else None)

    def ours_prefill() -> torch.Tensor:
        return ours_chunk(inputs=ours_step)

    def dispatched() -> torch.Tensor:
        return chosen(inputs=layer_step)

    def dispatched_public() -> torch.Tensor:
        # the layer's path through fla's public call: what the direct forward saves
        return chunk_gated_delta_rule_fla(inputs=layer_step, kernel=chunk_gated_delta_rule)

    paths = []
    if triton_prefill:
        paths.append(("ours (Triton)", median_ms(ours_prefill), ours_prefill()))
    direct = kernel == "fla" and isinstance(bound["kernel"], FlaDirectForward)
    paths.append((f"ours (dispatch: {kernel}{', direct forward' if direct else ''})",
                  median_ms(dispatched), dispatched()))
    if direct:
        paths.append(("ours (dispatch: fla, public call)", median_ms(dispatched_public),
                      dispatched_public()))
    t_fla = None
    if chunk_gated_delta_rule is not None:

        def fla_prefill() -> torch.Tensor:
            o, _ = chunk_gated_delta_rule(
                q[None],
                k[None],
                v[None],
                decay[None],
                beta[None],
                scale=scale,
                output_final_state=True,
                use_qk_l2norm_in_kernel=True,
            )
            return o[0]

        initial = torch.zeros(1, H, K, V, device="cuda")
        chunks = fla_chunk_indices([0, T], 64, q.device)

        def fla_varlen() -> torch.Tensor:
            # the call the wrapper makes: varlen offsets, an initial state, a chunk map
            o, _ = chunk_gated_delta_rule(
                q[None], k[None], v[None], decay[None], beta[None], scale=scale,
                initial_state=initial, output_final_state=True,
                use_qk_l2norm_in_kernel=True, cu_seqlens=cu.long(), chunk_indices=chunks,
            )  # fmt: skip
            return o[0]

        out_fla = fla_prefill()
        t_fla = median_ms(fla_prefill)
        print(f"prefill T={T} H={H}: fla kernel alone {t_fla * 1e3:.0f} us")
        t_varlen = median_ms(fla_varlen)
        print(f"prefill T={T} H={H}: fla varlen call (cu_seqlens, initial state) "
              f"{t_varlen * 1e3:.0f} us, {t_varlen / t_fla:.2f}x fla alone")
    for name, t, out in paths:
        line = f"prefill T={T} H={H}: {name} {t * 1e3:.0f} us"
        if t_fla is not None:
            line += (f", ratio to fla {t / t_fla:.2f} (target <= 1.0), "
                     f"rel err vs fla {rel_err(out.float(), out_fla.float()):.1e}")
        print(line)
    if profiled:
        gpu_ours = where_the_time_goes(f"ours (dispatch: {kernel})", dispatched)
        if direct:
            where_the_time_goes("ours (dispatch: fla, public call)", dispatched_public)
        if t_fla is not None:
            gpu_fla = where_the_time_goes("fla kernel alone", fla_prefill)
            where_the_time_goes("fla varlen call", fla_varlen)
            # where the host launches slower than the GPU runs, the wall ratio above is
            # one of host times: this one is the chip's
            print(f"  GPU kernel time, dispatched / fla alone: {gpu_ours / gpu_fla:.2f}")


if __name__ == "__main__":
    main()
