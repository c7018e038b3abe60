"""Host work per decode step, without a model: where a GPU step's non-GPU time goes.

The engine (scheduler, block manager) drives a stand-in executor that does the
runner's host-side share of a step - ``prepare_step`` on the step, a pickle round
trip of the step and of the reply as a tensor-parallel step makes, and one
``SampledToken`` per sequence - and samples a fixed token. Nothing runs on a
device, so this runs anywhere; compare it with the GPU step times in
docs/benchmarks.md to see how much of them is host work.

    python benchmarks/bench_host_step.py          # asynchronous steps (the default)
    python benchmarks/bench_host_step.py --sync   # one step at a time

With nothing on a device to overlap, both do the same host work; the difference is
the bookkeeping of a step in flight.
"""

from __future__ import annotations

import argparse
import pickle
import time

import torch

from kvrunner.batch import SampledToken, StepInput, unpack_sampled
from kvrunner.config import EngineConfig
from kvrunner.engine.llm_engine import LLMEngine
from kvrunner.runner.launched_step import DeviceTokens, feed_placeholders
from kvrunner.runner.step_batch import prepare_step
from kvrunner.sampling_params import SamplingParams

BATCHES = (64, 256)
PROMPT, NEW, BLOCK = 128, 256, 16


class HostOnlyExecutor:
    """The host side of a step; the model's tokens are a constant."""

    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self.previous: DeviceTokens | None = None
        self.input_ids = torch.zeros(8192, dtype=torch.int64)

    def execute(self, step: StepInput) -> list[SampledToken]:
        step = pickle.loads(pickle.dumps(step, protocol=pickle.HIGHEST_PROTOCOL))
        prepare_step(step, block_size=BLOCK)
        feed_placeholders(self.input_ids, step, self.previous)  # the last step's tokens
        cols = step  # as the runner's sampler reads and answers it
        seq_ids = [s for s, sample in zip(cols.seq_id, cols.sample, strict=True) if sample]
        self.previous = DeviceTokens(seq_ids, torch.full((len(seq_ids),), 7))
        packed = (seq_ids, [7] * len(seq_ids), [None] * len(seq_ids), [None] * len(seq_ids))
        return unpack_sampled(pickle.loads(pickle.dumps(packed)))


def step_ms(batch: int, *, async_scheduling: bool = True) -> float:
    """Mean host ms per decode step: (time for NEW tokens - time for 1) / (NEW - 1)."""

    def run(new: int) -> float:
        config = EngineConfig.load(
            model="tiny-qwen3", max_num_seqs=batch, max_model_len=PROMPT + NEW + 16,
            max_num_batched_tokens=8192, block_size=BLOCK, async_scheduling=async_scheduling,
        )
        blocks = batch * ((PROMPT + NEW + 16) // BLOCK + 1)
        engine = LLMEngine(config, HostOnlyExecutor(blocks), eos_token_ids=(0,),
                           vocab_size=1000, uses_state_slots=False)
        params = SamplingParams(max_tokens=new, temperature=0.0, ignore_eos=True)
        for i in range(batch):
            prompt = [1 + (i * 31 + j) % 997 for j in range(PROMPT)]
            engine.add_request(engine.make_request(prompt, params, i))
        start = time.perf_counter()
        while engine.has_unfinished():
            engine.step()
        return time.perf_counter() - start

    run(4)  # warm up
    return (run(NEW) - run(1)) / (NEW - 1) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sync", action="store_true", help="synchronous steps")
    args = parser.parse_args()
    print(f"{'batch':>5} {'host ms/step':>13} {'µs/sequence':>12}")
    for b in BATCHES:
        ms = step_ms(b, async_scheduling=not args.sync)
        print(f"{b:>5} {ms:>13.3f} {ms / b * 1e3:>12.2f}")


if __name__ == "__main__":
    main()
