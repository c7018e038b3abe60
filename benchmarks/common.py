"""Shared benchmark helpers: timing with CUDA events or in a CUDA graph, the measured copy
bandwidth, the top kernels of profiled decode steps."""

from __future__ import annotations

import time

import torch
import triton.testing


def median_ms(fn, *, warmup_ms: int = 50, rep_ms: int = 300) -> float:
    """Median milliseconds of ``fn()`` over repeated launches (CUDA events)."""
    return float(triton.testing.do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="median"))


def graph_ms(fn, *, rep_ms: int = 100) -> float:
    """Median milliseconds of ``fn()`` with the host out of the window: the calls are
    captured back to back in one CUDA graph and replayed (triton's
    ``do_bench_cudagraph``). For calls of tens of microseconds, where a Python launch
    costs more than the kernel and ``median_ms`` would time the host."""
    return float(triton.testing.do_bench_cudagraph(fn, rep=rep_ms, return_mode="median"))


def host_us(fn, calls: int = 50) -> float:
    """Host microseconds to launch one call of ``fn`` (no sync inside the loop): above the
    GPU's time per call, the host sets the pace."""
    fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    us = (time.perf_counter() - t0) / calls * 1e6
    torch.cuda.synchronize()
    return us


def copy_bandwidth_tbps(nbytes: int = 2 << 30) -> float:
    """Device-to-device copy bandwidth, counting bytes read plus bytes written."""
    buffers = torch.empty(2, nbytes, dtype=torch.uint8, device="cuda").random_(0, 255)
    ms = median_ms(lambda: buffers[1].copy_(buffers[0]))
    return 2 * nbytes / (ms * 1e-3) / 1e12


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.double(), ref.double()
    return float((out - ref).norm() / ref.norm().clamp_min(1e-30))


def print_top_kernels(prof, title: str, top: int = 10) -> None:
    """The ``top`` CUDA kernels of a ``torch.profiler`` run by device time, each with
    its share of all kernel time and its launch count, under ``title`` and the total."""
    events = [e for e in prof.key_averages() if e.device_type.name == "CUDA"]
    total = sum(e.self_device_time_total for e in events)
    events.sort(key=lambda e: e.self_device_time_total, reverse=True)
    print(f"{title}, {total / 1e3:.1f} ms in all")
    for e in events[:top]:
        print(f"  {e.self_device_time_total / max(total, 1):>6.1%} {e.count:>6}x  {e.key[:90]}")


def profile_decode_steps(prompts: list[list[int]], title: str, top: int = 10,
                         **engine: object) -> None:
    """Print the ``top`` kernels of 16 greedy decode steps over ``prompts`` on an eager
    engine built with ``engine``: a first call caches the prompts' KV, so the profiled
    call is the steps (and a token of prefill)."""
    from torch.profiler import ProfilerActivity, profile

    from kvrunner import LLM, SamplingParams

    with LLM(enforce_eager=True, **engine) as llm:
        llm.generate(prompts, SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True))
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            llm.generate(prompts, SamplingParams(max_tokens=17, temperature=0.0,
                                                 ignore_eos=True))
    print_top_kernels(prof, title, top)
