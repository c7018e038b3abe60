"""A sampling step's draw: the torch path vs the one-pass kernel, same logits, same run.

Seeded rows at temperature 1.0 without filters (an RL rollout's sampling), logits of
a 152k vocabulary in bf16 as a decode step hands them over (unwidened). Both paths
run through ``sample`` (``[kernels] fused_sampler`` off / on); the floor is one read of
the logits at the measured copy bandwidth. Also prints how many rows draw the same
token on both paths (all of them but close calls, which are rounding).

Then unseeded rows (an RL rollout's usual sampling): drawn from the engine's shared
generator on the torch path against keyed by the engine's seed and their request ids
on the kernel (how the engine draws them).

Then the kernel alone, captured in a CUDA graph (GPU time only): each row walked by
one program against the row cut into :func:`vocab_splits` slices and reduced, with
their tokens compared bit for bit.

    python benchmarks/bench_sampler.py [--batches 1,64,256,1024]
"""

from __future__ import annotations

import argparse

import torch
from common import copy_bandwidth_tbps, graph_ms, median_ms

from kvrunner.engine.step_io import SamplingColumns
from kvrunner.layers.fused.dispatch import kernels_chosen
from kvrunner.layers.fused.gumbel_argmax_triton import gumbel_argmax, vocab_splits
from kvrunner.layers.sampler import sample
from kvrunner.layers.sampling_seeds import request_keys
from kvrunner.sampling_params import SamplingParams

VOCAB = 151_936


def decode_logits(batch: int) -> torch.Tensor:
    """``[batch, VOCAB]`` bf16 logits as a decode step hands them over, seeded by the
    batch size (each table sees the same logits at a batch)."""
    g = torch.Generator(device="cuda").manual_seed(batch)
    return (torch.randn(batch, VOCAB, device="cuda", generator=g) * 3).to(torch.bfloat16)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", default="1,64,256,1024")
    args = ap.parse_args()
    bw = copy_bandwidth_tbps()
    print(f"copy bandwidth {bw:.2f} TB/s; vocab {VOCAB}, bf16 logits, seeded T=1.0")
    print(f"{'batch':>5} {'torch us':>9} {'fused us':>9} {'fused/torch':>11} "
          f"{'floor us':>9} {'fused/floor':>11} {'same tokens':>12}")
    for batch in (int(b) for b in args.batches.split(",")):
        logits = decode_logits(batch)
        # as a step carries them: the rows' sampling columns
        params = SamplingColumns.of(SamplingParams(temperature=1.0, seed=1000 + i)
                                    for i in range(batch))
        counts = list(range(batch))
        times, tokens = {}, {}
        for mode in ("0", "1"):
            with kernels_chosen(fused_sampler=mode == "1"):
                tokens[mode] = sample(logits, params, counts).token_ids
                times[mode] = median_ms(
                    lambda x=logits, p=params, c=counts: sample(x, p, c)) * 1e3
        floor = logits.numel() * logits.element_size() / (bw * 1e12) * 1e6
        same = int((tokens["0"] == tokens["1"]).sum())
        print(f"{batch:>5} {times['0']:>9.1f} {times['1']:>9.1f} "
              f"{times['1'] / times['0']:>11.2f} {floor:>9.1f} {times['1'] / floor:>11.2f} "
              f"{same:>6}/{batch:<5}")
    print(f"\nunseeded rows, T=1.0\n{'batch':>5} {'generator us':>12} {'keyed us':>9} "
          f"{'keyed/generator':>15}")
    for batch in (int(b) for b in args.batches.split(",")):
        logits = decode_logits(batch)
        params = SamplingColumns.of([SamplingParams(temperature=1.0)] * batch)
        counts = list(range(batch))
        keys = request_keys(0, list(range(batch)))
        g = torch.Generator(device="cuda").manual_seed(batch)
        shared = median_ms(lambda x=logits, p=params, c=counts, gen=g:
                           sample(x, p, c, generator=gen)) * 1e3
        keyed = median_ms(lambda x=logits, p=params, c=counts, k=keys:
                          sample(x, p, c, keys=k)) * 1e3
        print(f"{batch:>5} {shared:>12.1f} {keyed:>9.1f} {keyed / shared:>15.2f}")
    print(f"\nthe kernel alone, in a CUDA graph\n{'batch':>5} {'slices':>6} "
          f"{'one slice us':>12} {'sliced us':>9} {'sliced/one':>10} {'same tokens':>11}")
    for batch in (int(b) for b in args.batches.split(",")):
        logits = decode_logits(batch)
        rows = torch.arange(batch, device="cuda")
        temps = torch.ones(batch, device="cuda")
        seeds, counts = rows + 1000, rows.clone()
        splits = vocab_splits(batch, VOCAB, logits.device)
        args_ = (logits, rows, temps, seeds, counts)
        us = {k: graph_ms(lambda k=k, a=args_: gumbel_argmax(*a, splits=k)) * 1e3
              for k in (1, splits)}
        same = torch.equal(gumbel_argmax(*args_, splits=1), gumbel_argmax(*args_, splits=splits))
        print(f"{batch:>5} {splits:>6} {us[1]:>12.1f} {us[splits]:>9.1f} "
              f"{us[splits] / us[1]:>10.2f} {str(same):>11}")


if __name__ == "__main__":
    main()
