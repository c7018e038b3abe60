"""What programmatic dependent launch (PDL, sm_90+) would save between a decode step's
kernels: a go / no-go measurement before any kernel of ours takes it.

A batch-64 decode step of the 0.6B shape runs ~300 kernels in its graph, and the
profile counted the GPU idle ~0.8 µs between two of them (docs/benchmarks.md,
``profile_decode.py``). With PDL a kernel is launched while its predecessor drains
and waits for it at ``gdc_wait``. Three chains of 64 dependent kernels, each
captured in a CUDA graph, PDL off and on:

- an RMSNorm-sized Triton kernel (``[64, 1024]`` bf16 in, out) after itself;
- the same kernel alternating with a cuBLAS product of the 0.6B ``o_proj`` shape
  (``[64, 2048] x [2048, 1024]``): only the Triton side opts in, as it would in a
  step whose projections stay with cuBLAS;
- the product alone, for its own time.

Prints µs per link of each chain and what PDL saves a link.

    python benchmarks/bench_pdl_gaps.py
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from common import graph_ms

ROWS, WIDTH, LINKS = 64, 1024, 64


@triton.jit
def _scale_rows_kernel(x_ptr, out_ptr, width, BLOCK: tl.constexpr, USE_GDC: tl.constexpr):
    """One row a program: ``out = x * rsqrt(mean(x^2))``, an RMSNorm's traffic."""
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < width
    if USE_GDC:
        tl.extra.cuda.gdc_wait()  # the predecessor wrote x
    x = tl.load(x_ptr + row * width + cols, mask=mask, other=0.0).to(tl.float32)
    if USE_GDC:
        tl.extra.cuda.gdc_launch_dependents()  # the next kernel may start launching
    rstd = tl.rsqrt(tl.sum(x * x, 0) / width + 1e-6)
    tl.store(out_ptr + row * width + cols, (x * rstd).to(out_ptr.dtype.element_ty), mask=mask)


def scale_rows(x: torch.Tensor, out: torch.Tensor, pdl: bool) -> torch.Tensor:
    _scale_rows_kernel[(x.shape[0],)](x, out, x.shape[1], BLOCK=triton.next_power_of_2(x.shape[1]),
                                      USE_GDC=pdl, launch_pdl=pdl)
    return out


def main() -> None:
    if torch.cuda.get_device_capability()[0] < 9:
        print("PDL needs sm_90 or newer")
        return
    gen = torch.Generator(device="cuda").manual_seed(0)
    a, b = (torch.randn(ROWS, WIDTH, device="cuda", generator=gen).to(torch.bfloat16)
            for _ in "ab")
    wide = torch.randn(ROWS, 2 * WIDTH, device="cuda", generator=gen).to(torch.bfloat16)
    weight = (torch.randn(2 * WIDTH, WIDTH, device="cuda", generator=gen) * 0.02).to(
        torch.bfloat16)

    def triton_chain(pdl: bool) -> None:
        for i in range(LINKS):
            scale_rows(a if i % 2 == 0 else b, b if i % 2 == 0 else a, pdl)

    def mixed_chain(pdl: bool) -> None:
        for _ in range(LINKS // 2):
            torch.mm(wide, weight, out=a)
            scale_rows(a, b, pdl)  # reads what the product wrote

    def gemm_chain() -> None:
        for _ in range(LINKS // 2):
            torch.mm(wide, weight, out=a)

    off, on = scale_rows(a, b.clone(), False), scale_rows(a, b.clone(), True)
    print(f"PDL changes nothing in the result: {torch.equal(off, on)}")
    for name, fn, links in (("Triton after Triton", triton_chain, LINKS),
                            ("Triton after cuBLAS", mixed_chain, LINKS)):
        fn(False)
        fn(True)  # compiled before capture
        ms_off, ms_on = graph_ms(lambda f=fn: f(False)), graph_ms(lambda f=fn: f(True))
        per_off, per_on = ms_off * 1e3 / links, ms_on * 1e3 / links
        print(f"{name}: {per_off:.2f} us a link without PDL, {per_on:.2f} with "
              f"({per_off - per_on:+.2f} us saved a link)")
    print(f"the product alone: {graph_ms(gemm_chain) * 1e3 / (LINKS // 2):.2f} us a call")


if __name__ == "__main__":
    main()
