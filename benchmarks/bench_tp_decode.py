"""Tensor-parallel decode: TP=2 vs TP=1 tokens/s on the Qwen3-0.6B-shaped checkpoint.

Needs two GPUs (NCCL). Same method as bench_e2e_decode.py: decode ms/step =
(time for 256 new tokens - time for 1) / 255, batch 64 and 256, CUDA graphs on.

    python benchmarks/bench_tp_decode.py
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import torch
from bench_e2e_decode import NEW, PROMPT, ours_step_ms, release_memory, write_checkpoint

from kvrunner import LLM

BATCHES = (64, 256)


def main() -> None:
    if torch.cuda.device_count() < 2:
        raise SystemExit("needs 2 CUDA devices")
    path = Path(tempfile.mkdtemp()) / "qwen3-0.6b-random"
    write_checkpoint(path)
    results: dict[int, dict[int, float]] = {}
    for tp in (1, 2):
        with LLM(
            model=str(path),
            dtype="bfloat16",
            tensor_parallel_size=tp,
            max_num_seqs=max(BATCHES),
            max_model_len=PROMPT + NEW + 16,
            max_num_batched_tokens=8192,
            gpu_memory_utilization=0.6,
        ) as llm:
            results[tp] = {b: ours_step_ms(llm, b) for b in BATCHES}
        # The TP=1 runner lives in this process: its pool must be gone before the
        # TP=2 ranks measure what cuda:0 has free.
        del llm
        release_memory()
    print(
        f"{'batch':>5} {'TP1 ms/step':>12} {'TP1 tok/s':>10} {'TP2 ms/step':>12} "
        f"{'TP2 tok/s':>10} {'TP2/TP1':>8}"
    )
    for b in BATCHES:
        one, two = results[1][b], results[2][b]
        print(
            f"{b:>5} {one:>12.3f} {b / one * 1e3:>10.0f} {two:>12.3f} {b / two * 1e3:>10.0f} "
            f"{one / two:>8.2f}"
        )


if __name__ == "__main__":
    main()
