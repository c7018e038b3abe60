"""An RL-shaped rollout and time-to-first-token: kvrunner vs transformers, one run.

Random checkpoint of the Qwen3-0.6B shape (bench_e2e_decode's). Measured, each with
the peer (transformers ``generate`` on the same GPU) in the same run:

- rollout: batch 256, prompts of 1,024 random tokens, 512 new, seeded sampling
  (temperature 1.0, one seed per request), bf16; generated tokens/s. Ours with
  asynchronous steps on and off (``async_scheduling``).
- prompt-heavy fp32: batch 32, prompts of 1,024 and of 1,900 tokens, 64 new, greedy.
- time to first token at batch 1 for a 4,096-token prompt (bf16).

Floors printed beside: the rollout's decode reads the weights and the KV written so
far once per step (HBM bytes over the measured copy bandwidth), and its prefill does
2 x parameters x tokens FLOPs at ~790 bf16 TFLOP/s.

    python benchmarks/bench_rollout.py [--skip-hf]
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch
from bench_e2e_decode import KV_PER_TOKEN, SHAPE, release_memory, write_checkpoint
from common import copy_bandwidth_tbps

from kvrunner import LLM, SamplingParams

BATCH, PROMPT, NEW = 256, 1024, 512
BF16_TFLOPS = 790.0


def random_prompts(batch: int, length: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(1, SHAPE["vocab"], (batch, length), generator=g).tolist()


def ours_seconds(path: Path, dtype: str, prompts: list[list[int]], params: list[SamplingParams],
                 **config) -> float:
    longest = max(map(len, prompts)) + max(p.max_tokens for p in params) + 16
    with LLM(model=str(path), dtype=dtype, max_num_seqs=len(prompts), max_model_len=longest,
             max_num_batched_tokens=16384, gpu_memory_utilization=0.7, **config) as llm:
        llm.generate(prompts[:2], params[:2])  # warm up
        llm.reset_prefix_cache()
        torch.cuda.synchronize()
        start = time.perf_counter()
        llm.generate(prompts, params)
        torch.cuda.synchronize()
        seconds = time.perf_counter() - start
    release_memory()
    return seconds


def hf_seconds(model, prompts: list[list[int]], new: int, *, sample: bool) -> float:
    ids = torch.tensor(prompts, device="cuda")
    kwargs = dict(do_sample=True, temperature=1.0, top_k=0) if sample else dict(do_sample=False)
    model.generate(ids[:2, :16], max_new_tokens=2, pad_token_id=0, **kwargs)  # warm up
    torch.cuda.synchronize()
    start = time.perf_counter()
    model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new,
                   min_new_tokens=new, pad_token_id=0, **kwargs)
    torch.cuda.synchronize()
    return time.perf_counter() - start


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument("--rollout-only", action="store_true",
                    help="only the bf16 rollout with asynchronous steps (and its peer)")
    args = ap.parse_args()
    path = Path(tempfile.mkdtemp()) / "qwen3-0.6b-random"
    weight_bytes = write_checkpoint(path, max_positions=8192)  # room for the 4k TTFT prompt
    bw = copy_bandwidth_tbps() * 1e12
    rows = []

    prompts = random_prompts(BATCH, PROMPT, seed=1)
    sampled = [SamplingParams(max_tokens=NEW, temperature=1.0, seed=i, ignore_eos=True)
               for i in range(BATCH)]
    on = ours_seconds(path, "bfloat16", prompts, sampled)
    off = float("nan") if args.rollout_only else ours_seconds(
        path, "bfloat16", prompts, sampled, async_scheduling=False)
    decode_floor = sum(weight_bytes + BATCH * (PROMPT + i) * KV_PER_TOKEN for i in range(NEW)) / bw
    prefill_floor = 2 * weight_bytes / 2 * BATCH * PROMPT / (BF16_TFLOPS * 1e12)
    floor = decode_floor + prefill_floor
    rollout = [("rollout bf16 (async on)", BATCH * NEW, on, floor),
               ("rollout bf16 (async off)", BATCH * NEW, off, floor)]

    heavy = []
    for length in () if args.rollout_only else (1024, 1900):
        p = random_prompts(32, length, seed=length)
        greedy = [SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True)] * 32
        heavy.append((f"fp32 prompts {length}", 32 * 64, ours_seconds(path, "float32", p, greedy),
                      p))

    long_prompt = random_prompts(1, 4096, seed=7)
    one = [SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)]
    ttft = float("nan") if args.rollout_only else ours_seconds(path, "bfloat16", long_prompt, one)

    hf: dict[str, float] = {}
    if not args.skip_hf:
        import transformers

        for dtype in (torch.bfloat16,) if args.rollout_only else (torch.bfloat16, torch.float32):
            model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=dtype).cuda()
            model.eval()
            if dtype == torch.bfloat16:
                hf["rollout"] = hf_seconds(model, prompts, NEW, sample=True)
                if not args.rollout_only:
                    hf["ttft"] = hf_seconds(model, long_prompt, 1, sample=False)
            else:
                for name, _, _, p in heavy:
                    hf[name] = hf_seconds(model, p, 64, sample=False)
            del model
            release_memory()

    print(f"{'run':>26} {'tokens':>7} {'ours s':>8} {'tok/s':>9} {'HF s':>8} {'ours vs HF':>10} "
          f"{'floor s':>8} {'ours/floor':>10}")
    for name, tokens, secs, fl in rollout:
        peer = hf.get("rollout", float("nan"))
        rows.append((name, tokens, secs, peer, fl))
    for name, tokens, secs, _ in heavy:
        rows.append((name, tokens, secs, hf.get(name, float("nan")), float("nan")))
    prefill_4k = 2 * weight_bytes / 2 * 4096 / (BF16_TFLOPS * 1e12)
    rows.append(("TTFT 4k prompt, batch 1", 1, ttft, hf.get("ttft", float("nan")), prefill_4k))
    for name, tokens, secs, peer, fl in rows:
        print(f"{name:>26} {tokens:>7} {secs:>8.3f} {tokens / secs:>9.0f} {peer:>8.3f} "
              f"{peer / secs:>10.2f} {fl:>8.3f} {secs / fl:>10.2f}")


if __name__ == "__main__":
    main()
