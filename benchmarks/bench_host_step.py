"""Host work per decode step, without a model: where a GPU step's non-GPU time goes.

The engine (scheduler, block manager) drives a stand-in executor that does the
runner's host-side share of a step - ``prepare_step`` on the step, its placeholders
fed, and the sampled columns unpacked as the engine reads them - and samples a
fixed token. Nothing runs on a device, so this runs anywhere; compare it with the
GPU step times in docs/benchmarks.md to see how much of them is host work.

    python benchmarks/bench_host_step.py          # one rank, asynchronous steps
    python benchmarks/bench_host_step.py --sync   # one step at a time
    python benchmarks/bench_host_step.py --pickle # plus TP's pipe: step and reply pickled
    python benchmarks/bench_host_step.py --staggered  # requests ending apart
    python benchmarks/bench_host_step.py --queued     # room for half: the rest admitted

With nothing on a device to overlap, both do the same host work; the difference is
the bookkeeping of a step in flight.
"""

from __future__ import annotations

import argparse
import pickle
import time

import torch

from kvrunner.config import EngineConfig
from kvrunner.engine.llm_engine import LLMEngine
from kvrunner.engine.step_io import SampledToken, StepInput, unpack_sampled
from kvrunner.runner.step.launched_step import DeviceTokens, feed_placeholders
from kvrunner.runner.step.step_batch import prepare_step
from kvrunner.sampling_params import SamplingParams

BATCHES = (64, 256, 1024)
PROMPT, NEW, BLOCK = 128, 256, 16


class HostOnlyExecutor:
    """The host side of a step; the model's tokens are a constant."""

    def __init__(self, num_blocks: int, *, pickled: bool) -> None:
        self.num_blocks = num_blocks
        #: round-trip the step and the reply through pickle, as a spawned TP group does
        self.pickled = pickled
        self.previous: DeviceTokens | None = None
        self.input_ids = torch.zeros(8192, dtype=torch.int64)

    def execute(self, step: StepInput) -> list[SampledToken]:
        if self.pickled:
            step = pickle.loads(pickle.dumps(step, protocol=pickle.HIGHEST_PROTOCOL))
        prepare_step(step, block_size=BLOCK)
        feed_placeholders(self.input_ids, step, self.previous)  # the last step's tokens
        cols = step  # as the runner's sampler reads and answers it
        seq_ids = [s for s, sample in zip(cols.seq_id, cols.sample, strict=True) if sample]
        self.previous = DeviceTokens(seq_ids, torch.full((len(seq_ids),), 7))
        packed = (seq_ids, [7] * len(seq_ids), [None] * len(seq_ids), [None] * len(seq_ids))
        if self.pickled:
            packed = pickle.loads(pickle.dumps(packed, protocol=pickle.HIGHEST_PROTOCOL))
        return unpack_sampled(packed)


def step_ms(
    batch: int, *, async_scheduling: bool = True, pickled: bool = False, repeats: int = 3,
    staggered: bool = False, queued: bool = False,
) -> float:
    """Mean host ms per decode step: (time for NEW tokens - time for 1) / (NEW - 1),
    each the fastest of ``repeats`` runs (the machine is shared: noise only adds).

    ``queued``: room for half the requests at once, the rest admitted as others end
    (with ``staggered``, one or a few a step); then the figure is a whole run's host
    time over its steps, prefills included."""
    steps = [0]

    def run(new: int) -> float:
        config = EngineConfig.load(
            model="tiny-qwen3", max_num_seqs=batch // 2 if queued else batch,
            max_model_len=PROMPT + NEW + 16,
            max_num_batched_tokens=8192, block_size=BLOCK, async_scheduling=async_scheduling,
        )
        blocks = batch * ((PROMPT + NEW + 16) // BLOCK + 1)
        engine = LLMEngine(config, HostOnlyExecutor(blocks, pickled=pickled), eos_token_ids=(0,),
                           vocab_size=1000, uses_state_slots=False)
        for i in range(batch):
            prompt = [1 + (i * 31 + j) % 997 for j in range(PROMPT)]
            # staggered: requests end one after another over the run's second half
            length = new - (i * (new // 2) // batch if staggered and new > 1 else 0)
            params = SamplingParams(max_tokens=length, temperature=0.0, ignore_eos=True)
            engine.add_request(engine.make_request(prompt, params, i))
        start = time.perf_counter()
        steps[0] = 0
        while engine.has_unfinished():
            engine.step()
            steps[0] += 1
        return time.perf_counter() - start

    run(4)  # warm up
    full = min(run(NEW) for _ in range(repeats))
    if queued:
        return full / steps[0] * 1e3
    prefill = min(run(1) for _ in range(repeats))
    return (full - prefill) / (NEW - 1) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sync", action="store_true", help="synchronous steps")
    parser.add_argument("--pickle", action="store_true",
                        help="pickle the step and the reply, as a spawned TP group does")
    parser.add_argument("--batches", type=int, nargs="+", default=BATCHES)
    parser.add_argument("--repeats", type=int, default=3, help="runs per figure (the min)")
    parser.add_argument("--staggered", action="store_true",
                        help="requests end one after another (max_tokens from NEW down "
                             "to NEW / 2), not all on the last step")
    parser.add_argument("--queued", action="store_true",
                        help="room for half the requests: the rest admitted as others end")
    args = parser.parse_args()
    print(f"{'batch':>5} {'host ms/step':>13} {'µs/sequence':>12}")
    for b in args.batches:
        ms = step_ms(b, async_scheduling=not args.sync, pickled=args.pickle,
                     repeats=args.repeats, staggered=args.staggered, queued=args.queued)
        print(f"{b:>5} {ms:>13.3f} {ms / b * 1e3:>12.2f}")


if __name__ == "__main__":
    main()
