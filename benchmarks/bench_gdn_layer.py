"""One GDN layer's prefill core from the layer's own input, fla's path: the conv, the
split into q/k/v, the chunked recurrence (fla through the pool wrapper), two ways in
one run:

- column slices: the conv's ``[T, conv_dim]`` output cut into q/k/v views, which fla's
  call copies to dense tensors (the layer before the sectioned conv);
- sections: the conv writes q, k and v as three dense tensors
  (``conv1d_prefill_split_triton``, the layer's fla path now).

Qwen3-Next-80B-A3B's heads (16 key / 32 value heads of 128, conv kernel 4), one fresh
sequence of T = 4,096, bf16. Prints wall time, GPU kernel time per call (the host
launches these slower than the GPU runs them, so the GPU time is the one a model step
sees), and the copies' byte floor.

    python benchmarks/bench_gdn_layer.py
"""

from __future__ import annotations

import torch
from bench_gdn import where_the_time_goes
from common import copy_bandwidth_tbps, median_ms, rel_err

from kvrunner_gdn.kernels.conv_prefill import conv1d_prefill_split_triton, conv1d_prefill_triton
from kvrunner_gdn.kernels.fla_prefill import fla_chunk_kernel, gdn_prefill_fla
from kvrunner_gdn.state import STATE_DTYPE

HK, HV, DK, DV, WIDTH, T = 16, 32, 128, 128, 4, 4096


def main() -> None:
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
    host = dict(cu_seqlens_host=[0, T], host_indices=([-1], [0]))
    conv = (mixed, conv_state, weight, None, cu, read, write, T)

    def recurrence(q2: torch.Tensor, k2: torch.Tensor, v2: torch.Tensor) -> torch.Tensor:
        q, k = (t.unflatten(1, (HK, DK)) for t in (q2, k2))
        return gdn_prefill_fla(q, k, v2.unflatten(1, (HV, DV)), g, beta, ssm_state, cu, read,
                               write, DK**-0.5, kernel=kernel, **host)

    def column_slices() -> torch.Tensor:
        return recurrence(*conv1d_prefill_triton(*conv).split(sections, 1))

    def dense_sections() -> torch.Tensor:
        return recurrence(*conv1d_prefill_split_triton(*conv, sections))

    bw = copy_bandwidth_tbps()
    copy_bytes = 2 * T * conv_dim * mixed.element_size()  # each of q/k/v read and written
    print(f"copy bandwidth {bw:.2f} TB/s; the q/k/v copies' floor "
          f"{copy_bytes / (bw * 1e12) * 1e6:.1f} us ({copy_bytes / 2**20:.0f} MiB moved)")
    want = column_slices()
    err = rel_err(dense_sections().float(), want.float())
    gpu = {}
    for name, fn in (("column slices (copied by fla's call)", column_slices),
                     ("dense sections", dense_sections)):
        print(f"{name}: wall {median_ms(fn) * 1e3:.0f} us")
        gpu[name] = where_the_time_goes(name, fn)
    slices, dense = gpu.values()
    print(f"GPU time, sections / slices: {dense / slices:.3f} ({slices - dense:.1f} us saved a "
          f"layer); output rel err {err:.1e}")


if __name__ == "__main__":
    main()
