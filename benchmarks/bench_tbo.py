"""Two-batch overlap at TP=2, 8B shape: TBO on vs off, in one run, on two GPUs.

Decode ms/step at batch 64 and 256 (bench_e2e_decode's method, CUDA graphs on) and
one prefill step of 8,192 tokens (8 prompts of 1,024), each with ``overlap="tbo"``
(every step split: thresholds 2) and without. The all-reduce alone is timed at the
prefill's size ([8192, 4096] bf16, two per layer) with NCCL in the same run, so the
most overlap could hide is printed beside the gain. Floors: decode reads each
rank's half of the weights once per step (HBM bytes / copy bandwidth); prefill does
2 x parameters x tokens FLOPs, half per rank, at the H200's ~790 dense bf16 TFLOP/s.

    python benchmarks/bench_tbo.py
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from bench_e2e_decode import ours_step_ms, release_memory, write_checkpoint
from bench_tp_decode import SHAPES
from common import copy_bandwidth_tbps

from kvrunner import LLM, SamplingParams

BATCHES, PREFILL_PROMPTS, PREFILL_LEN = (64, 256), 8, 1024
BF16_TFLOPS = 790.0


def prefill_ms(llm: LLM, seed: int = 3) -> float:
    g = torch.Generator().manual_seed(seed)
    prompts = torch.randint(10, 150000, (PREFILL_PROMPTS, PREFILL_LEN), generator=g).tolist()
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    llm.generate(prompts, params)  # warm up, and fill the prefix cache we then reset
    best = float("inf")
    for _ in range(3):
        llm.reset_prefix_cache()
        torch.cuda.synchronize()
        start = time.perf_counter()
        llm.generate(prompts, params)
        best = min(best, (time.perf_counter() - start) * 1e3)
    return best


def measure(path: Path, overlap: str) -> tuple[dict[int, float], float]:
    with LLM(model=str(path), dtype="bfloat16", tensor_parallel_size=2, overlap=overlap,
             overlap_min_tokens=2, overlap_min_decode_seqs=2, max_num_seqs=max(BATCHES),
             max_model_len=PREFILL_LEN + 272, max_num_batched_tokens=PREFILL_PROMPTS * PREFILL_LEN,
             gpu_memory_utilization=0.6) as llm:
        decode = {b: ours_step_ms(llm, b) for b in BATCHES}
        prefill = prefill_ms(llm)
    del llm
    release_memory()
    return decode, prefill


def _all_reduce_ms(rank: int, out: dict) -> None:
    dist.init_process_group("nccl", init_method="tcp://127.0.0.1:29541", rank=rank,
                            world_size=2, device_id=torch.device("cuda", rank))
    x = torch.randn(PREFILL_PROMPTS * PREFILL_LEN, SHAPES["8B"]["hidden"], device=f"cuda:{rank}",
                    dtype=torch.bfloat16)
    for _ in range(5):
        dist.all_reduce(x)
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(20):
        dist.all_reduce(x)
    torch.cuda.synchronize()
    if rank == 0:
        out["ms"] = (time.perf_counter() - start) / 20 * 1e3
    dist.destroy_process_group()


def all_reduce_ms() -> float:
    out = mp.Manager().dict()
    mp.spawn(_all_reduce_ms, args=(out,), nprocs=2)
    return out["ms"]


def main() -> None:
    if torch.cuda.device_count() < 2:
        raise SystemExit("needs 2 CUDA devices")
    shape = SHAPES["8B"]
    path = Path(tempfile.mkdtemp()) / "qwen3-8B-random"
    weight_bytes = write_checkpoint(path, shape)
    params = weight_bytes / 2
    bw = copy_bandwidth_tbps() * 1e12
    ar = all_reduce_ms()
    off_decode, off_prefill = measure(path, "none")
    on_decode, on_prefill = measure(path, "tbo")
    print(f"all-reduce [{PREFILL_PROMPTS * PREFILL_LEN}, {shape['hidden']}] bf16: {ar:.3f} ms; "
          f"x{2 * shape['layers']} per prefill step = {2 * shape['layers'] * ar:.1f} ms")
    print(f"{'step':>14} {'TBO off ms':>11} {'TBO on ms':>10} {'on/off speed':>13} "
          f"{'floor ms':>9} {'on / floor':>10}")
    for b in BATCHES:
        floor = weight_bytes / 2 / bw * 1e3
        print(f"{'decode ' + str(b):>14} {off_decode[b]:>11.3f} {on_decode[b]:>10.3f} "
              f"{off_decode[b] / on_decode[b]:>13.2f} {floor:>9.3f} {on_decode[b] / floor:>10.2f}")
    tokens = PREFILL_PROMPTS * PREFILL_LEN
    floor = 2 * params * tokens / 2 / (BF16_TFLOPS * 1e12) * 1e3
    print(f"{'prefill 8192':>14} {off_prefill:>11.1f} {on_prefill:>10.1f} "
          f"{off_prefill / on_prefill:>13.2f} {floor:>9.1f} {on_prefill / floor:>10.2f}")


if __name__ == "__main__":
    main()
