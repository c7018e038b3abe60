"""Host work of a whole decode step, on any machine: ``LLM.generate`` through the
real engine, runner and sampler, with the model's compute replaced by constants.

The tiny Qwen3 checkpoint runs on the CPU; the runner's eager forward returns a fixed
hidden state and its logits are a fixed tensor, and a graph replay returns what a
decode graph ends with (fixed logits, greedy tokens and row maxima), so what is timed
is the host's share of a step: scheduling, block bookkeeping, step
preparation and metadata, placeholders, sampling over a small vocabulary, reading
the samples back and applying them. Compare with the GPU's step time to see whether
asynchronous steps can hide it.

    python benchmarks/bench_host_path.py [--batches 64,256,1024] [--profile]
"""

from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import tempfile
import time
from pathlib import Path

import torch

from kvrunner import LLM, SamplingParams
from kvrunner.models.tiny import write_tiny_checkpoint
from kvrunner.runner.capture.graph_sampling import DecodeOutputs

PROMPT, NEW = 64, 64


def host_ms_per_step(batch: int, *, profile: bool = False) -> float:
    path = write_tiny_checkpoint(Path(tempfile.mkdtemp()) / "q", kind="qwen3")
    llm = LLM(model=str(path), device="cpu", max_num_seqs=batch,
              max_model_len=PROMPT + NEW + 8, max_num_batched_tokens=16384,
              num_blocks=batch * ((PROMPT + NEW + 8) // 16 + 2))
    runner = llm.runner
    hidden_size = json.loads((path / "config.json").read_text())["hidden_size"]
    hidden = torch.zeros(16384, hidden_size)
    vocab = llm.engine.vocab_size
    logits = torch.zeros(batch, vocab)
    logits[:, 7] = 1.0
    runner._forward_rows = lambda n, ctx: hidden[:n]  # no model compute
    # A replayed graph ends with its logits and greedy tokens (runner/capture/graph_sampling.py)
    tokens, row_max = torch.full((batch,), 7), torch.ones(batch)
    for graph in runner.graph_capture.graphs.values():
        b = graph.batch_size
        graph.replay = lambda b=b: DecodeOutputs(None, logits[:b], tokens[:b], row_max[:b])
    runner.model.compute_logits = lambda x, **_: logits[: x.shape[0]]
    prompts = [[1 + (i * 31 + j) % (vocab - 1) for j in range(PROMPT)] for i in range(batch)]

    def run(new: int) -> float:
        start = time.perf_counter()
        llm.generate(prompts, SamplingParams(max_tokens=new, temperature=0.0, ignore_eos=True))
        return time.perf_counter() - start

    run(4)  # warm up
    best = min(run(NEW) - run(1) for _ in range(3)) / (NEW - 1)
    if profile:
        prof = cProfile.Profile()
        prof.enable()
        run(NEW)
        prof.disable()
        pstats.Stats(prof).sort_stats("tottime").print_stats(25)
    llm.shutdown()
    return best * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", default="64,256,1024")
    ap.add_argument("--profile", action="store_true", help="cProfile the largest batch")
    args = ap.parse_args()
    torch.set_num_threads(1)
    batches = [int(b) for b in args.batches.split(",")]
    print(f"{'batch':>5} {'host ms/step':>13} {'µs/sequence':>12}")
    for b in batches:
        ms = host_ms_per_step(b, profile=args.profile and b == max(batches))
        print(f"{b:>5} {ms:>13.3f} {ms / b * 1e3:>12.2f}")


if __name__ == "__main__":
    main()
