"""Where the host's time goes in a real decode step on the GPU: cProfile of greedy
decode on the Qwen3-0.6B shape (the checkpoint of ``bench_e2e_decode.py``).

``bench_host_path.py`` times the host's share with the model stubbed (any machine);
this one keeps the GPU, so the CUDA calls a step makes (copies, launches, events,
the graph launch) are in the profile too. cProfile's own cost per Python call
inflates the Python-heavy parts; read the shares, not the absolute times.

    python benchmarks/profile_host_step.py [--batches 1,64] [--new 128] [--top 30]
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import tempfile
import time
from pathlib import Path

import torch
from bench_e2e_decode import PROMPT, prompts, write_checkpoint

from kvrunner import LLM, SamplingParams


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", default="1,64")
    ap.add_argument("--new", type=int, default=128)
    ap.add_argument("--top", type=int, default=30)
    args = ap.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    path = Path(tempfile.mkdtemp()) / "qwen3-0.6b-random"
    write_checkpoint(path)
    llm = LLM(model=str(path), dtype="bfloat16", max_num_seqs=max(batches),
              max_model_len=PROMPT + args.new + 16,
              max_num_batched_tokens=max(8192, max(batches) * PROMPT),
              gpu_memory_utilization=0.5)
    for batch in batches:
        params = SamplingParams(max_tokens=args.new, temperature=0.0, ignore_eos=True)
        llm.generate(prompts(batch, 1), params)  # warm up this batch
        torch.cuda.synchronize()
        start = time.perf_counter()
        llm.generate(prompts(batch, 2), params)
        torch.cuda.synchronize()
        plain_ms = (time.perf_counter() - start) / args.new * 1e3
        prof = cProfile.Profile()
        prof.enable()
        llm.generate(prompts(batch, 3), params)
        torch.cuda.synchronize()
        prof.disable()
        print(f"\n== batch {batch}: {plain_ms:.3f} ms/step unprofiled (prefill included), "
              f"{args.new} steps profiled", flush=True)
        stats = pstats.Stats(prof)
        stats.sort_stats("tottime").print_stats(args.top)
    llm.shutdown()


if __name__ == "__main__":
    main()
