"""What the step audit (``audit=True``) costs a decode step, beside the same engine without it.

The audit checksums every pool row before and after each step and compares the
core's step buffers (``runner/step/step_audit.py``), so its floor is two reads of
the whole pool per step at the copy bandwidth: the cost grows with the pool, not
the batch. On CUDA the shape is Qwen3-0.6B's (random bf16 weights, prompts of 128
tokens) over a pool sized for batch 256; ``--tiny`` runs the embedded tiny model on
the CPU instead. Prints ms per decode step with the audit off and on, their ratio,
the pool's bytes and the audit's floor.

    python benchmarks/bench_sanitizer.py            # CUDA, 0.6B shape, batch 1 / 64 / 256
    python benchmarks/bench_sanitizer.py --tiny     # CPU, tiny-qwen3
"""

from __future__ import annotations

import argparse
import gc
import tempfile
import time
from pathlib import Path

import torch

from kvrunner import LLM, SamplingParams
from kvrunner.models.tiny import write_tiny_checkpoint

BATCHES = (1, 64, 256)
PROMPT, NEW = 128, 32
BLOCK = 16


def step_ms(llm: LLM, batch: int, new: int) -> float:
    """Decode ms per step: (time for ``new`` tokens - time for 1) / (``new`` - 1)."""
    prompts = [[(7 * i + j) % 400 + 5 for j in range(PROMPT)] for i in range(batch)]

    def run(tokens: int) -> float:
        params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        start = time.perf_counter()
        llm.generate(prompts, params)
        return time.perf_counter() - start

    run(2)  # warm up this batch's kernels
    return (run(new) - run(1)) / (new - 1) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tiny", action="store_true", help="the tiny model on the CPU")
    ap.add_argument("--new", type=int, default=NEW, help="decode steps timed per batch")
    args = ap.parse_args()
    root = Path(tempfile.mkdtemp())
    if args.tiny:
        path = write_tiny_checkpoint(root / "tiny", kind="qwen3", seed=0)
        batches, dtype = (1, 16, 64), "float32"
    else:
        from bench_e2e_decode import write_checkpoint

        path = root / "qwen3-0.6b-random"
        write_checkpoint(path)
        batches, dtype = BATCHES, "bfloat16"
    num_blocks = max(batches) * -(-(PROMPT + args.new + 16) // BLOCK) + 64
    settings = dict(model=str(path), dtype=dtype, max_num_seqs=max(batches),
                    max_model_len=PROMPT + args.new + 16, block_size=BLOCK,
                    max_num_batched_tokens=max(batches) * PROMPT, num_blocks=num_blocks)
    rows = {}
    for audit in (False, True):
        llm = LLM(audit=audit, **settings)
        pool_bytes = sum(t.numel() * t.element_size() for t in llm.runner.cache.pools.values())
        rows[audit] = {b: step_ms(llm, b, args.new) for b in batches}
        if audit:
            steps = llm.runner.launcher.audit.steps
        del llm
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    if torch.cuda.is_available() and not args.tiny:
        from common import copy_bandwidth_tbps

        bandwidth = copy_bandwidth_tbps() * 1e12
        floor = f"{2 * pool_bytes / bandwidth * 1e3:.2f} ms (two reads of the pool)"
    else:
        floor = "n/a on the CPU"
    print(f"pool {pool_bytes / 1e9:.3f} GB ({num_blocks} blocks of {BLOCK}); audit floor "
          f"{floor}; {steps} audited steps")
    print(f"{'batch':>5} {'off ms/step':>12} {'audit ms/step':>14} {'added ms':>9} {'ratio':>6}")
    for b in batches:
        off, on = rows[False][b], rows[True][b]
        print(f"{b:>5} {off:>12.3f} {on:>14.3f} {on - off:>9.3f} {on / off:>6.2f}")


if __name__ == "__main__":
    main()
