"""Where a decode step's time goes: a torch.profiler trace of greedy decode steps
on the Qwen3-0.6B shape (the checkpoint of ``bench_e2e_decode.py``).

Prints, per batch: wall ms per step, GPU busy ms per step (kernels and copies,
summed), the kernels a decode step runs and how long the GPU sits idle between them
(the launch latency inside a graph), and the ops that take the most device time and
the most host time.

With ``--deterministic both`` it profiles the default mode, then deterministic mode
(``deterministic=True``) on the same checkpoint; ``--deterministic on``, that mode alone.

    python benchmarks/profile_decode.py [--batches 1,64,256] [--steps 16] [--deterministic on|both]
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch
from bench_e2e_decode import PROMPT, prompts, write_checkpoint
from torch.profiler import ProfilerActivity, profile

from kvrunner import LLM, SamplingParams


def profile_batch(llm: LLM, batch: int, steps: int) -> None:
    params = SamplingParams(max_tokens=steps + 1, temperature=0.0, ignore_eos=True)
    llm.generate(prompts(batch, 1), params)  # warm up this batch's kernels
    first = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    llm.generate(prompts(batch, 2), first)
    torch.cuda.synchronize()
    prefill_s = time.perf_counter() - t0
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        llm.generate(prompts(batch, 3), params)  # fresh prompts: no prefix-cache hits
        torch.cuda.synchronize()
        wall_s = time.perf_counter() - t0
    events = prof.key_averages()
    kernels = [e for e in events if e.device_type == torch.autograd.DeviceType.CUDA]
    gpu_us = sum(e.self_device_time_total for e in kernels)
    print(
        f"\n== batch {batch}: {(wall_s - prefill_s) / steps * 1e3:.3f} ms/step (profiled), "
        f"GPU busy {gpu_us / (steps + 1) / 1e3:.3f} ms/step (prefill step included)"
    )
    print_gaps(prof, steps)
    print(events.table(sort_by="self_device_time_total", row_limit=14, max_name_column_width=60))
    print(events.table(sort_by="self_cpu_time_total", row_limit=14, max_name_column_width=60))


def print_gaps(prof: profile, steps: int) -> None:
    """Kernels per decode step, their summed time, and the GPU's idle time between them.

    Only device work that starts after the first graph launch counts (the prefill
    step runs eagerly before it); the idle time is the span less the union of the
    kernels' intervals, so it is what launch latency and dependencies cost."""
    launches = [e.time_range.start for e in prof.events() if e.name == "cudaGraphLaunch"]
    if not launches:
        print("no graph launch in the profile")
        return
    spans = sorted(
        (e.time_range.start, e.time_range.end)
        for e in prof.events()
        if e.device_type == torch.autograd.DeviceType.CUDA and e.time_range.start >= launches[0]
    )
    busy = union = 0.0
    reach = spans[0][0]
    for start, end in spans:
        busy += end - start
        union += max(0.0, end - max(start, reach))
        reach = max(reach, end)
    span = reach - spans[0][0]
    n = len(launches)
    print(f"decode steps after the first graph launch: {n}; per step {len(spans) / n:.0f} "
          f"kernels, {busy / n:.1f} us summed, {union / n:.1f} us busy, "
          f"{(span - union) / n:.1f} us idle between kernels ({(span - union) / span:.0%} "
          f"of the span; {(span - union) / max(1, len(spans) - n):.2f} us a gap)")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", default="1,64,256")
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--deterministic", choices=("off", "on", "both"), default="off")
    args = ap.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    path = Path(tempfile.mkdtemp()) / "qwen3-0.6b-random"
    write_checkpoint(path)
    modes = {"off": (False,), "on": (True,), "both": (False, True)}[args.deterministic]
    for deterministic in modes:
        print(f"\n==== deterministic={deterministic}")
        with LLM(
            model=str(path),
            dtype="bfloat16",
            deterministic=deterministic,
            max_num_seqs=max(batches),
            max_model_len=PROMPT + args.steps + 16,
            gpu_memory_utilization=0.5,
        ) as llm:
            for batch in batches:
                profile_batch(llm, batch, args.steps)


if __name__ == "__main__":
    main()
