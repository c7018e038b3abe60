"""Tensor-parallel decode: TP=2 vs TP=1 tokens/s on two GPUs of one host (NCCL).

Same method as bench_e2e_decode.py: decode ms/step = (time for 256 new tokens -
time for 1) / 255, batch 64 and 256, CUDA graphs on. Two random bf16 checkpoints:
the Qwen3-0.6B shape the issue names, and a Qwen3-8B shape (embeddings tied, so
7.6B parameters), where the weights each step reads are large enough for halving
them to outweigh the all-reduces. TP=2 runs twice: with the default all-reduce
(symmetric memory for decode-sized tensors) and with NCCL only.

    python benchmarks/bench_tp_decode.py [0.6B] [8B]
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import torch
from bench_e2e_decode import NEW, PROMPT, SHAPE, ours_step_ms, release_memory, write_checkpoint

from kvrunner import LLM

BATCHES = (64, 256)
SHAPES = {
    "0.6B": SHAPE,
    "8B": dict(hidden=4096, inter=12288, layers=36, heads=32, kv_heads=8, head_dim=128,
               vocab=151936),
}


def measure(path: Path, tp: int, all_reduce: str = "auto") -> dict[int, float]:
    with LLM(
        model=str(path),
        dtype="bfloat16",
        tensor_parallel_size=tp,
        all_reduce=all_reduce,
        max_num_seqs=max(BATCHES),
        max_model_len=PROMPT + NEW + 16,
        max_num_batched_tokens=8192,
        gpu_memory_utilization=0.6,
    ) as llm:
        if tp > 1:
            used = {r["all_reduce"] for r in llm.executor.describe_ranks()}
            print(f"TP={tp} all_reduce={all_reduce!r}: ranks use {sorted(used)}", flush=True)
        result = {b: ours_step_ms(llm, b) for b in BATCHES}
    # The TP=1 runner lives in this process: its pool must be gone before the
    # TP=2 ranks measure what cuda:0 has free.
    del llm
    release_memory()
    return result


def main() -> None:
    if torch.cuda.device_count() < 2:
        raise SystemExit("needs 2 CUDA devices")
    names = sys.argv[1:] or list(SHAPES)
    rows = []
    for name in names:
        path = Path(tempfile.mkdtemp()) / f"qwen3-{name}-random"
        weight_gb = write_checkpoint(path, SHAPES[name]) / 1e9
        one, two, two_nccl = measure(path, 1), measure(path, 2), measure(path, 2, "nccl")
        rows += [(name, weight_gb, b, one[b], two[b], two_nccl[b]) for b in BATCHES]
    print(
        f"{'model':>5} {'GB':>5} {'batch':>5} {'TP1 ms/step':>12} {'TP2 ms/step':>12} "
        f"{'TP2 tok/s':>10} {'TP2/TP1':>8} {'TP2 NCCL-only ms':>17} {'its TP2/TP1':>12}"
    )
    for name, gb, b, one, two, two_nccl in rows:
        print(
            f"{name:>5} {gb:>5.2f} {b:>5} {one:>12.3f} {two:>12.3f} {b / two * 1e3:>10.0f} "
            f"{one / two:>8.2f} {two_nccl:>17.3f} {one / two_nccl:>12.2f}"
        )


if __name__ == "__main__":
    main()
