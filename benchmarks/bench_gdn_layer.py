"""One GDN layer's prefill core from the layer's own input, fla's path: the conv, the
split into q/k/v, the chunked recurrence (fla through the pool wrapper), two ways in
one run:

- column slices: the conv's ``[T, conv_dim]`` output cut into q/k/v views, which fla's
  call copies to dense tensors;
- sections: the conv writes q, k and v as three dense tensors
  (``short_conv_prefill_split``, the layer's fla path), in the same one output
  launch.

Both tell the conv that the sequence covers every row (``total_tokens``), as the
layer does, so neither zero-fills its output first.

Qwen3-Next-80B-A3B's heads (16 key / 32 value heads of 128, conv kernel 4), one fresh
sequence of T = 4,096, bf16. Prints wall time, GPU kernel time per call (the host
launches these slower than the GPU runs them, so the GPU time is the one a model step
sees), and the copies' byte floor.

    python benchmarks/bench_gdn_layer.py [--host-profile]   (cProfile of the recurrence's
                                                          launches, each way)
"""

from __future__ import annotations

import cProfile
import pstats
import sys

import torch
from bench_gdn import where_the_time_goes
from common import copy_bandwidth_tbps, host_us, median_ms, rel_err

from kvrunner_gdn.ops.gated_delta_rule.chunk_fla import chunk_gated_delta_rule_fla, fla_chunk_kernel
from kvrunner_gdn.ops.gated_delta_rule.inputs import GatedDeltaRuleInputs
from kvrunner_gdn.ops.short_conv.inputs import ShortConvInputs
from kvrunner_gdn.ops.short_conv.prefill import short_conv_prefill, short_conv_prefill_split
from kvrunner_gdn.state import STATE_DTYPE

HK, HV, DK, DV, WIDTH, T = 16, 32, 128, 128, 4, 4096


def main() -> None:
    host_profile = "--host-profile" in sys.argv
    kernel = fla_chunk_kernel()
    if kernel is None:
        print("fla unavailable: this bench measures fla's path only")
        return
    key_dim, value_dim = HK * DK, HV * DV
    sections = (key_dim, key_dim, value_dim)
    conv_dim = sum(sections)
    gen = torch.Generator(device="cuda").manual_seed(0)
    rand = lambda *shape: torch.randn(*shape, device="cuda", generator=gen)
    mixed = rand(T, conv_dim).to(torch.bfloat16)
    weight = (rand(conv_dim, WIDTH) * 0.3).to(torch.bfloat16)
    conv_state = torch.zeros(2, conv_dim, WIDTH - 1, device="cuda", dtype=STATE_DTYPE)
    ssm_state = torch.zeros(2, HV, DK, DV, device="cuda", dtype=STATE_DTYPE)
    g = -torch.rand(T, HV, device="cuda", generator=gen) * 0.1
    beta = torch.rand(T, HV, device="cuda", generator=gen).to(torch.bfloat16)
    cu = torch.tensor([0, T], dtype=torch.int32, device="cuda")
    read = torch.tensor([-1], dtype=torch.int32, device="cuda")  # fresh: no history read
    write = torch.tensor([0], dtype=torch.int32, device="cuda")
    conv = ShortConvInputs(x=mixed, conv_state=conv_state, weight=weight, read_indices=read,
                           write_indices=write, cu_seqlens=cu, max_seqlen=T, total_tokens=T)

    def recurrence(q2: torch.Tensor, k2: torch.Tensor, v2: torch.Tensor) -> torch.Tensor:
        q, k = (t.unflatten(1, (HK, DK)) for t in (q2, k2))
        return chunk_gated_delta_rule_fla(inputs=GatedDeltaRuleInputs(
            q=q, k=k, v=v2.unflatten(1, (HV, DV)), g=g, beta=beta, state=ssm_state,
            read_indices=read, write_indices=write, scale=DK**-0.5, cu_seqlens=cu,
            cu_seqlens_host=[0, T], host_indices=([-1], [0])), kernel=kernel)

    def slices_conv() -> tuple[torch.Tensor, ...]:
        return short_conv_prefill(inputs=conv).split(sections, 1)

    def sections_conv() -> tuple[torch.Tensor, ...]:
        return short_conv_prefill_split(inputs=conv, sections=sections)

    def column_slices() -> torch.Tensor:
        return recurrence(*slices_conv())

    def dense_sections() -> torch.Tensor:
        return recurrence(*sections_conv())

    bw = copy_bandwidth_tbps()
    copy_bytes = 2 * T * conv_dim * mixed.element_size()  # each of q/k/v read and written
    print(f"copy bandwidth {bw:.2f} TB/s; the q/k/v copies' floor "
          f"{copy_bytes / (bw * 1e12) * 1e6:.1f} us ({copy_bytes / 2**20:.0f} MiB moved)")
    want = column_slices()
    err = rel_err(dense_sections().float(), want.float())
    gpu = {}
    ways = (("column slices (copied by fla's call)", column_slices),
            ("dense sections", dense_sections))
    for name, fn in ways:
        print(f"{name}: wall {median_ms(fn) * 1e3:.0f} us")
        gpu[name] = where_the_time_goes(name, fn)
    # Timed again in both orders: in the first calls the way timed second (the sections)
    # was slower in wall time by 58-326 us, though its GPU time was lower and its conv
    # cost the host the same to launch.
    walls = {name: [] for name, _ in ways}
    for name, fn in (*ways[::-1], *ways):
        walls[name].append(median_ms(fn) * 1e3)
    print("wall again, sections first, then slices first: " + "; ".join(
        f"{name.split(' (')[0]} {' / '.join(f'{us:.0f}' for us in times)} us"
        for name, times in walls.items()))
    for name, fn in (("column slices", slices_conv), ("dense sections", sections_conv)):
        print(f"the conv alone, {name}: host {host_us(fn):.0f} us to launch a call")
        inputs = fn()
        print(f"the recurrence alone, {name}: host "
              f"{host_us(lambda i=inputs: recurrence(*i)):.0f} us to launch a call")
        if host_profile:
            stats = cProfile.Profile()
            stats.runcall(lambda i=inputs: [recurrence(*i) for _ in range(50)])
            torch.cuda.synchronize()
            pstats.Stats(stats).sort_stats("tottime").print_stats(14)
    slices, dense = gpu.values()
    print(f"GPU time, sections / slices: {dense / slices:.3f} ({slices - dense:.1f} us saved a "
          f"layer); output rel err {err:.1e}")


if __name__ == "__main__":
    main()
