"""Deterministic mode's cost and accuracy on the Qwen3-0.6B shape (H200, bf16).

In one run, deterministic off and on:

* decode throughput at batch 1, 64 and 256 (prompts of 128, 256 tokens each,
  greedy, ignore_eos), tokens/s of the decode phase;
* the RL-shaped rollout: 256 prompts of 1,024 tokens, 512 sampled each (seeded,
  temperature 1), wall seconds of the whole generate;
* the logprob gap per generated token between the engine and a transformers forward
  on the same weights (bf16 and fp32), mean and max of |difference|.

Prints the slowdown of each (targets: at most 15% at each decode batch, 12% on the
rollout; vLLM's batch-invariant mode pays 22-31% and SGLang's 34% with graphs).
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import attrs
import torch
from bench_e2e_decode import release_memory, write_checkpoint
from common import profile_decode_steps

from kvrunner import LLM, SamplingParams

DECODE_BATCHES = (1, 64, 256)
DECODE_PROMPT, DECODE_NEW = 128, 256
ROLLOUT_BATCH, ROLLOUT_PROMPT, ROLLOUT_NEW = 256, 1024, 512
GAP_PROMPTS, GAP_PROMPT, GAP_NEW = 8, 256, 64


def prompts(batch: int, length: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(10, 150000, (batch, length), generator=g).tolist()


def engine(path: Path, deterministic: bool, batch: int, longest: int) -> LLM:
    return LLM(model=str(path), dtype="bfloat16", deterministic=deterministic,
               max_num_seqs=max(batch, 8), max_model_len=longest + 16,
               max_num_batched_tokens=16384, gpu_memory_utilization=0.7)


def timed(llm: LLM, batch: list[list[int]], params: SamplingParams) -> float:
    llm.generate(batch[:2], attrs.evolve(params, max_tokens=4))  # warm up
    llm.reset_prefix_cache()
    torch.cuda.synchronize()
    start = time.perf_counter()
    llm.generate(batch, params)
    torch.cuda.synchronize()
    return time.perf_counter() - start


def decode_tokens_per_s(path: Path, deterministic: bool, batch: int) -> float:
    """Decode-phase tokens/s: a run of DECODE_NEW tokens less a run of one token."""
    batch_prompts = prompts(batch, DECODE_PROMPT, seed=batch)
    with engine(path, deterministic, batch, DECODE_PROMPT + DECODE_NEW) as llm:
        greedy = SamplingParams(max_tokens=DECODE_NEW, temperature=0.0, ignore_eos=True)
        full = timed(llm, batch_prompts, greedy)
        prefill = timed(llm, batch_prompts, attrs.evolve(greedy, max_tokens=1))
    release_memory()
    return batch * (DECODE_NEW - 1) / max(full - prefill, 1e-9)


def rollout_seconds(path: Path, deterministic: bool) -> float:
    batch_prompts = prompts(ROLLOUT_BATCH, ROLLOUT_PROMPT, seed=7)
    params = SamplingParams(max_tokens=ROLLOUT_NEW, temperature=1.0, seed=0, ignore_eos=True)
    with engine(path, deterministic, ROLLOUT_BATCH, ROLLOUT_PROMPT + ROLLOUT_NEW) as llm:
        seconds = timed(llm, batch_prompts, params)
    release_memory()
    return seconds


def generated(path: Path, deterministic: bool) -> list[tuple[list[int], list[int], list[float]]]:
    batch_prompts = prompts(GAP_PROMPTS, GAP_PROMPT, seed=11)
    params = SamplingParams(max_tokens=GAP_NEW, temperature=1.0, seed=3, logprobs=0,
                            ignore_eos=True)
    with engine(path, deterministic, GAP_PROMPTS, GAP_PROMPT + GAP_NEW) as llm:
        outs = llm.generate(batch_prompts, params)
    release_memory()
    return [(p, o.token_ids, o.logprobs) for p, o in zip(batch_prompts, outs, strict=True)]


def gaps(path: Path, rollouts, dtype: torch.dtype) -> tuple[float, float]:
    """Mean and max |engine logprob - transformers logprob| per generated token."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=dtype).cuda().eval()
    diffs = []
    with torch.no_grad():
        for prompt, out, logprobs in rollouts:
            ids = torch.tensor([prompt + out], device="cuda")
            ref = torch.log_softmax(model(ids).logits[0].float(), -1)
            at = torch.arange(len(prompt) - 1, len(prompt) + len(out) - 1, device="cuda")
            want = ref[at, torch.tensor(out, device="cuda")]
            diffs.append((torch.tensor(logprobs, device="cuda") - want).abs())
    del model
    release_memory()
    d = torch.cat(diffs)
    return float(d.mean()), float(d.max())


def profile_decode(path: Path, deterministic: bool, batch: int = 256, top: int = 10) -> None:
    """The kernels of eager decode steps at ``batch`` (prompts of 1,024): the ``top``
    by device time, with their share of all kernel time."""
    profile_decode_steps(
        prompts(batch, ROLLOUT_PROMPT, seed=batch),
        f"deterministic={deterministic}: kernels of a prefill and 16 decode steps at batch "
        f"{batch}", top,
        model=str(path), dtype="bfloat16", deterministic=deterministic, max_num_seqs=batch,
        max_model_len=ROLLOUT_PROMPT + 64, max_num_batched_tokens=16384,
        gpu_memory_utilization=0.7)
    release_memory()


def sweep_splits(path: Path, kinds: str, batches: tuple[int, ...] = DECODE_BATCHES) -> None:
    """Decode tok/s at each of ``batches``, the default mode's and deterministic mode's
    under other policies of ``kinds`` (comma-separated):

    * ``attention``: other key splits of the fixed-order attention (``KEY_SPLIT``, a
      number of keys, so each keeps a token's order its own);
    * ``gemm``: the invariant GEMM's K split (``MIN_SPLIT_DEPTH``, ``MAX_SPLITS``, a
      function of the weight's shape alone, so each keeps the products
      batch-invariant) and when a program walks every slice: from a row count
      (``IN_PROGRAM_ROWS``) or an output tile count (``WALK_TILES``), a layout: the
      same bits either way."""
    from kvrunner.layers.fused import invariant_gemm_triton as gemm
    from kvrunner_paged.ops.paged_attention import fixed_order

    kept = gemm.MIN_SPLIT_DEPTH, gemm.MAX_SPLITS, gemm.IN_PROGRAM_ROWS, gemm.WALK_TILES
    kept_split = fixed_order.KEY_SPLIT
    print(f"{'split depth, splits, walk rows, walk tiles':<44}" + "".join(
        f"{f'batch {b}':>12}" for b in batches))

    def row(label: str, deterministic: bool) -> None:
        rates = [decode_tokens_per_s(path, deterministic, b) for b in batches]
        print(f"{label:<44}" + "".join(f"{r:>12.0f}" for r in rates), flush=True)

    row("default mode", False)
    row(f"deterministic (key split {kept_split}, "
        f"{', '.join(map(str, kept))})", True)
    try:
        for kind in kinds.split(","):
            if kind == "attention":
                for key_split in (128, 256, 512):
                    fixed_order.KEY_SPLIT = key_split
                    row(f"attention key split {key_split}", True)
                fixed_order.KEY_SPLIT = kept_split
            elif kind == "gemm":
                for policy in ((256, 8, 512, None), (128, 16, 512, None), (512, 4, 128, None),
                               (512, 4, 64, None), (512, 4, 512, 132), (512, 4, 512, 256),
                               (1 << 30, 1, 512, None)):
                    (gemm.MIN_SPLIT_DEPTH, gemm.MAX_SPLITS, gemm.IN_PROGRAM_ROWS,
                     gemm.WALK_TILES) = policy
                    row("no split" if policy[1] == 1 else ", ".join(map(str, policy)), True)
                gemm.MIN_SPLIT_DEPTH, gemm.MAX_SPLITS, gemm.IN_PROGRAM_ROWS, gemm.WALK_TILES = kept
            else:
                raise SystemExit(f"--sweep-splits {kind!r}: the kinds are 'attention' "
                                 f"and 'gemm'")
    finally:
        gemm.MIN_SPLIT_DEPTH, gemm.MAX_SPLITS, gemm.IN_PROGRAM_ROWS, gemm.WALK_TILES = kept
        fixed_order.KEY_SPLIT = kept_split


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--profile", action="store_true",
                    help="first print the kernels of eager decode steps, off and on")
    ap.add_argument("--sweep-splits", nargs="?", const="attention,gemm", default=None,
                    help="only time decode, off and on under other key splits of the "
                         "attention and K splits of the GEMM ('attention', 'gemm' or both)")
    ap.add_argument("--batches", default=",".join(map(str, DECODE_BATCHES)),
                    help="--sweep-splits: the decode batches timed, comma-separated")
    args = ap.parse_args()
    root = Path(args.out or tempfile.mkdtemp())
    path = root / "qwen3-0.6b-random"
    write_checkpoint(path, max_positions=4096)
    if args.profile:
        for flag in (False, True):
            profile_decode(path, flag)
    if args.sweep_splits:
        sweep_splits(path, args.sweep_splits, tuple(int(b) for b in args.batches.split(",")))
        return
    print(f"{'case':<28}{'off':>12}{'on':>12}{'slowdown':>10}")
    for batch in DECODE_BATCHES:
        off, on = (decode_tokens_per_s(path, flag, batch) for flag in (False, True))
        print(f"{f'decode tok/s batch {batch}':<28}{off:>12.0f}{on:>12.0f}{off / on - 1:>10.1%}")
    off, on = (rollout_seconds(path, flag) for flag in (False, True))
    print(f"{'rollout 256x1024+512 (s)':<28}{off:>12.2f}{on:>12.2f}{on / off - 1:>10.1%}")
    print("logprob gap vs transformers, per generated token (mean / max |diff|):")
    for flag in (False, True):
        rollouts = generated(path, flag)
        for dtype in (torch.bfloat16, torch.float32):
            mean, worst = gaps(path, rollouts, dtype)
            print(f"  deterministic={flag!s:<5} vs HF {str(dtype).removeprefix('torch.'):<9}"
                  f" mean {mean:.2e}  max {worst:.2e}")


if __name__ == "__main__":
    main()
