"""FP8 weights against bf16 in one run: the rollout, the product alone, the push.

Random checkpoints of the Qwen3-0.6B and Qwen3-8B shapes (bf16, std 0.02); the FP8
engine quantizes them as they load (``quantization="fp8"``), as it quantizes a
trainer's push. Measured, FP8 and bf16 side by side on the same GPU:

- rollout: batch 256, prompts of 1,024 random tokens, 512 new, seeded sampling at
  temperature 1.0; generated tokens/s for bf16, FP8 weights, and FP8 weights with the
  FP8 KV cache (``kv_cache_dtype="fp8"``), each beside its own HBM floor (every decode
  step reads the weights as stored, FP8 bytes and scales or bf16, and the KV written
  so far in its dtype, at the measured copy bandwidth; the prefill at ~790 TFLOP/s
  bf16, twice that where the w8a8 product takes a prefill chunk's rows), and split:
  the prefill (the same prompts sampled for one token each) and the rest, the decode;
- the product alone (``layers/fp8/gemm.py``) at the 8B projections' shapes, decode
  (1, 16, 32, 64, 256 rows) and prefill (4,096 rows) sizes, each call replayed in a CUDA
  graph (as a decode step runs it): ``fp8_linear`` (the path it takes named), the
  w8a16 kernel, the w8a8 product alone (torch's ``scaled_mm``, and the Triton
  kernel ``layers/fp8/w8a8_triton.py``), the dequantizing fallback and bf16
  ``F.linear``, each beside the time to read its weight once;
- a push of the 8B shape's weights from CUDA tensors in bf16 (``update_weights``):
  into FP8 weights (quantized per 128 x 128 block as it loads) and into bf16 ones.

    python benchmarks/bench_fp8.py [--shapes 0.6b,8b] [--skip-rollout] [--variants bf16,...]
                                   [--sweep-w8a8] [--profile]

``--sweep-w8a8`` only sweeps the Triton w8a8 kernel's launches at the 8B shapes;
``--profile`` first prints the top kernels of eager decode steps of the rollout's batch
for each variant (the prompts' KV cached by a first call, so the steps are the
profile's work).
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import attrs
import torch
import torch.nn.functional as F
from bench_e2e_decode import SHAPE, release_memory, write_checkpoint
from common import copy_bandwidth_tbps, graph_ms, profile_decode_steps

from kvrunner import LLM, SamplingParams
from kvrunner.layers.fp8 import gemm
from kvrunner.layers.fp8.blocks import dequantize_blocks, quantize_blocks
from kvrunner.layers.fp8.gemm import (
    fp8_linear,
    w8a8_linear,
    w8a8_serves,
    w8a8_triton_linear,
    w8a16_serves,
)
from kvrunner.layers.fp8.w8a8_triton import W8A8Launch, default_launch
from kvrunner.layers.fp8.w8a16_triton import w8a16_linear
from kvrunner.models.loader import iter_safetensors

BATCH, PROMPT, NEW = 256, 1024, 512
BF16_TFLOPS = 790.0
SHAPES = {
    "0.6b": SHAPE,
    "8b": dict(hidden=4096, inter=12288, layers=36, heads=32, kv_heads=8, head_dim=128,
               vocab=SHAPE["vocab"]),
}
GEMM_ROWS = (1, 16, 32, 64, 256, 4096)
_FP8, _FP8_KV = {"quantization": "fp8"}, {"quantization": "fp8", "kv_cache_dtype": "fp8"}
#: the rollout's variants: engine settings
VARIANTS = {"bf16": {}, "fp8": _FP8, "fp8+kv8": _FP8_KV}
#: a prefill chunk's rows (``max_num_batched_tokens``)
CHUNK = 16384


def kv_per_token(s: dict[str, int], itemsize: int = 2) -> int:
    return s["layers"] * 2 * s["kv_heads"] * s["head_dim"] * itemsize


def weight_bytes(llm: LLM) -> int:
    """The bytes a decode step reads: every parameter as stored (FP8 bytes and scales)."""
    return sum(p.numel() * p.element_size() for p in llm.runner.model.parameters())


@attrs.frozen
class RolloutTimes:
    """The RL-shaped rollout's seconds and its floor's, whole and split: ``prefill`` is
    a call of the same prompts for one token each (the prompts' prefill, each sampling
    its first token from it; the prefix cache emptied first), ``decode`` the whole
    call's rest."""

    seconds: float
    prefill: float
    floor: float
    prefill_floor: float

    @property
    def decode(self) -> float:
        return self.seconds - self.prefill

    @property
    def decode_floor(self) -> float:
        return self.floor - self.prefill_floor


def rollout(path: Path, s: dict[str, int], bw: float, **config) -> RolloutTimes:
    """The RL-shaped rollout's seconds beside its floor's."""
    g = torch.Generator().manual_seed(1)
    prompts = torch.randint(1, s["vocab"], (BATCH, PROMPT), generator=g).tolist()
    params = [SamplingParams(max_tokens=NEW, temperature=1.0, seed=i, ignore_eos=True)
              for i in range(BATCH)]
    first = [attrs.evolve(p, max_tokens=1) for p in params]

    def timed(llm: LLM, params: list[SamplingParams]) -> float:
        llm.reset_prefix_cache()
        torch.cuda.synchronize()
        start = time.perf_counter()
        llm.generate(prompts, params)
        torch.cuda.synchronize()
        return time.perf_counter() - start

    with LLM(model=str(path), dtype="bfloat16", max_num_seqs=BATCH,
             max_model_len=PROMPT + NEW + 16, max_num_batched_tokens=CHUNK,
             gpu_memory_utilization=0.9, **config) as llm:
        nbytes = weight_bytes(llm)
        llm.generate(prompts[:2], params[:2])
        seconds = timed(llm, params)
        prefill_seconds = timed(llm, first)
    release_memory()
    fp8 = config.get("quantization") == "fp8"
    kv = kv_per_token(s, 1 if config.get("kv_cache_dtype") == "fp8" else 2)
    decode = sum(nbytes + BATCH * (PROMPT + i) * kv for i in range(NEW)) / bw
    params_count = nbytes / (1 if fp8 else 2)
    # FP8 tensor cores run at twice bf16's rate where the w8a8 product takes the rows
    # (asked of the hidden size's shape; only the weight's shape and the card decide)
    x = torch.empty(1, s["hidden"], device="cuda", dtype=torch.bfloat16)
    w = torch.empty(s["hidden"], s["hidden"], device="cuda", dtype=torch.float8_e4m3fn)
    tflops = BF16_TFLOPS * (2 if fp8 and w8a8_serves(x, w) else 1)
    prefill = 2 * params_count * BATCH * PROMPT / (tflops * 1e12)
    return RolloutTimes(seconds=seconds, prefill=prefill_seconds, floor=decode + prefill,
                        prefill_floor=prefill)


def profile_decode(path: Path, s: dict[str, int], label: str, top: int = 12) -> None:
    """The ``top`` kernels of 16 eager decode steps of the rollout's batch (prompts
    of 1,024) under variant ``label``, by device time."""
    g = torch.Generator().manual_seed(1)
    profile_decode_steps(
        torch.randint(1, s["vocab"], (BATCH, PROMPT), generator=g).tolist(),
        f"{label}: kernels of 16 decode steps at batch {BATCH}", top,
        model=str(path), dtype="bfloat16", max_num_seqs=BATCH, max_model_len=PROMPT + 64,
        max_num_batched_tokens=CHUNK, gpu_memory_utilization=0.9, **VARIANTS[label])
    release_memory()


def gemm_rows(s: dict[str, int], bw: float) -> list[tuple]:
    h, i, q = s["hidden"], s["inter"], s["heads"] * s["head_dim"]
    kv = s["kv_heads"] * s["head_dim"]
    rows = []
    for name, (n, k) in {"qkv": (q + 2 * kv, h), "o": (h, q), "gate_up": (2 * i, h),
                         "down": (h, i)}.items():
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
        wq, ws = quantize_blocks(w)
        for m in GEMM_ROWS:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            fp8_linear(x, wq, ws)  # eager first: a w8a8 refusal is met outside the graph
            path = ("w8a16" if w8a16_serves(x, wq)
                    else ("w8a8 tri" if m <= gemm.W8A8_TRITON_MAX_ROWS else "w8a8")
                    if w8a8_serves(x, wq) else "dequant")
            fp8 = graph_ms(lambda x=x, wq=wq, ws=ws: fp8_linear(x, wq, ws))
            w8a16 = graph_ms(lambda x=x, wq=wq, ws=ws: w8a16_linear(x, wq, ws))
            w8a8_tri = graph_ms(lambda x=x, wq=wq, ws=ws: w8a8_triton_linear(x, wq, ws))
            w8a8 = float("nan")  # where the card has no w8a8, or torch refuses the call
            if w8a8_serves(x, wq):
                try:
                    w8a8 = graph_ms(lambda x=x, wq=wq, ws=ws: w8a8_linear(x, wq, ws))
                except RuntimeError as refused:
                    print(f"w8a8 {name} at {m} rows: {str(refused).splitlines()[0][:160]}")
            dequant = graph_ms(
                lambda x=x, wq=wq, ws=ws: F.linear(x, dequantize_blocks(wq, ws, x.dtype)))
            bf16 = graph_ms(lambda x=x, w=w: F.linear(x, w))
            rows.append((name, m, n, k, path, fp8, w8a16, w8a8, w8a8_tri, dequant, bf16,
                         n * k / bw * 1e3, 2 * n * k / bw * 1e3))
    return rows


#: the Triton w8a8 launches the sweep tries beside each default
SWEEP_LAUNCHES = [W8A8Launch(bm, bn, splits, warps, stages)
                  for bm in (16, 32, 64) for bn in (64, 128) for warps in (4, 8)
                  for stages in (3, 4) for splits in (1, 4)] + [
    W8A8Launch(128, bn, splits, 8, stages)
    for bn in (64, 128) for stages in (3, 4) for splits in (1, 4)]
#: decode steps' rows where the w8a8 product serves (fewer go to w8a16)
SWEEP_ROWS = (32, 64, 256)


def sweep_w8a8(s: dict[str, int], bw: float) -> None:
    """For the 8B projections at decode row counts: torch's ``scaled_mm`` w8a8 (with the
    activations' quantization), the Triton w8a8 kernel's default launch and its fastest
    of :data:`SWEEP_LAUNCHES`, ms a call replayed in a CUDA graph, beside the FP8 floor."""
    h, i, q = s["hidden"], s["inter"], s["heads"] * s["head_dim"]
    kv = s["kv_heads"] * s["head_dim"]
    print(f"{'proj':>8} {'rows':>5} {'scaled_mm':>9} {'tri dflt':>9} {'tri best':>9} "
          f"{'fp8 flr':>8}  best launch (default launch)")
    for name, (n, k) in {"qkv": (q + 2 * kv, h), "o": (h, q), "gate_up": (2 * i, h),
                         "down": (h, i)}.items():
        wq, ws = quantize_blocks(torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02)
        for m in SWEEP_ROWS:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            mm = graph_ms(lambda x=x, wq=wq, ws=ws: w8a8_linear(x, wq, ws))
            timed = {}
            for launch in [default_launch(m, n, k), *SWEEP_LAUNCHES]:
                if launch in timed:
                    continue
                try:
                    timed[launch] = graph_ms(
                        lambda x=x, wq=wq, ws=ws, launch=launch: w8a8_triton_linear(
                            x, wq, ws, launch=launch), rep_ms=30)
                except Exception as failed:  # a launch the compiler or the card refuses
                    timed[launch] = float("inf")
                    print(f"{name} {m} rows, {launch}: {str(failed).splitlines()[0][:120]}")
            best = min(timed, key=timed.get)
            dflt = default_launch(m, n, k)
            print(f"{name:>8} {m:>5} {mm:>9.4f} {timed[dflt]:>9.4f} {timed[best]:>9.4f} "
                  f"{n * k / bw * 1e3:>8.4f}  {best} ({dflt})", flush=True)


def push_seconds(path: Path, **config) -> float:
    """One ``update_weights`` of every tensor, bf16 on CUDA, median of three."""
    tensors = {n: t.cuda() for n, t in iter_safetensors(path, torch.bfloat16)}
    times = []
    with LLM(model=str(path), dtype="bfloat16", max_num_seqs=8, max_model_len=256,
             gpu_memory_utilization=0.6, enforce_eager=True, **config) as llm:
        for _ in range(3):
            torch.cuda.synchronize()
            start = time.perf_counter()
            llm.update_weights(tensors)
            torch.cuda.synchronize()
            times.append(time.perf_counter() - start)
    del tensors
    release_memory()
    return sorted(times)[1]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="0.6b,8b")
    ap.add_argument("--skip-rollout", action="store_true")
    ap.add_argument("--variants", default=",".join(VARIANTS),
                    help=f"the rollout's variants, comma-separated (bf16 first: the others' "
                         f"ratios are to it): {', '.join(VARIANTS)}")
    ap.add_argument("--profile", action="store_true",
                    help="first print the top kernels of eager decode steps per variant")
    ap.add_argument("--sweep-w8a8", action="store_true",
                    help="only sweep the Triton w8a8 kernel's launches at the 8B shapes")
    args = ap.parse_args()
    unknown = set(args.variants.split(",")) - VARIANTS.keys()
    if unknown or not args.variants.startswith("bf16"):
        ap.error(f"--variants {args.variants!r}: bf16 first, then any of {', '.join(VARIANTS)}")
    bw = copy_bandwidth_tbps() * 1e12
    if args.sweep_w8a8:
        sweep_w8a8(SHAPES["8b"], bw)
        return
    root = Path(tempfile.mkdtemp())
    print(f"{torch.cuda.get_device_name()}, copy bandwidth {bw / 1e12:.2f} TB/s")
    for shape in args.shapes.split(","):
        s = SHAPES[shape]
        path = root / f"qwen3-{shape}-random"
        write_checkpoint(path, s, max_positions=4096)
        if args.profile:
            for label in args.variants.split(","):
                profile_decode(path, s, label)
        if not args.skip_rollout:
            print(f"\nrollout {shape}: batch {BATCH}, prompts {PROMPT}, {NEW} sampled")
            print(f"{'weights':>8} {'s':>8} {'tok/s':>9} {'floor s':>8} {'s/floor':>8} "
                  f"{'prefill s':>10} {'floor':>6} {'decode s':>9} {'floor':>6}")
            results = {}
            for label in args.variants.split(","):
                t = rollout(path, s, bw, **VARIANTS[label])
                results[label] = t.seconds
                print(f"{label:>8} {t.seconds:>8.2f} {BATCH * NEW / t.seconds:>9.0f} "
                      f"{t.floor:>8.2f} {t.seconds / t.floor:>8.2f} {t.prefill:>10.2f} "
                      f"{t.prefill_floor:>6.2f} {t.decode:>9.2f} {t.decode_floor:>6.2f}")
            for label in [r for r in results if r != "bf16"]:
                print(f"{label} tokens/s over bf16: "
                      f"{results['bf16'] / results[label]:.2f}x")
        if shape == "8b":
            print("\nproduct alone (8B projections), ms in CUDA graphs; "
                  "floors read the weight once")
            print(f"{'proj':>8} {'rows':>5} {'N':>6} {'K':>6} {'path':>7} {'fp8':>8} "
                  f"{'w8a16':>8} {'w8a8':>8} {'w8a8 tri':>8} {'dequant':>8} {'bf16':>8} "
                  f"{'fp8 flr':>8} {'bf16 flr':>8}")
            for r in gemm_rows(s, bw):
                print(f"{r[0]:>8} {r[1]:>5} {r[2]:>6} {r[3]:>6} {r[4]:>7} "
                      + " ".join(f"{v:>8.4f}" for v in r[5:]))
            fp8_push = push_seconds(path, quantization="fp8")
            bf16_push = push_seconds(path)
            print(f"\npush of the 8B shape from CUDA bf16 tensors: into fp8 {fp8_push:.3f} s, "
                  f"into bf16 {bf16_push:.3f} s ({fp8_push / bf16_push:.2f}x)")


if __name__ == "__main__":
    main()
