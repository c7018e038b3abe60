"""The main job: an RL-style rollout loop on one engine.

Each round generates the same batch (seeded sampling, so a correct runtime repeats
itself exactly), then recaptures every decode graph the way a trainer's weight sync
would force — with forward_vars still holding the last served batch's live rows.
A capture that wrote into the cache would show up as NaN rows or as outputs that
differ from round 1.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from kvrunner.llm import LLM
from kvrunner.sampling_params import SamplingParams

_TEXT = (
    "the policy samples a rollout and the trainer updates its weights then the engine "
    "wakes recaptures its graphs and serves the next batch of prompts"
)
_WORDS = _TEXT.split()


def rollout_prompts(batch: int) -> list[str]:
    """``batch`` prompts of different lengths, the same every call."""
    return [
        " ".join(_WORDS[(i * 7) % len(_WORDS) :] + _WORDS[: 3 + (i * 5) % 11]) for i in range(batch)
    ]


def run_rollout(
    *,
    config_file: str | Path | None,
    rounds: int,
    batch: int,
    max_tokens: int,
    config: dict[str, Any],
) -> int:
    """Run the loop and print one table row per round; returns a process exit code."""
    llm = LLM(config_file=config_file, progress=True, **config)
    prompts = rollout_prompts(batch)
    params = [
        SamplingParams(max_tokens=max_tokens, temperature=1.0, seed=1000 + i, ignore_eos=True)
        for i in range(batch)
    ]
    info = llm.executor.model_info

    def rank0() -> dict[str, Any]:
        # Every rank computes the same logits; rank 0 speaks for the group.
        return llm.executor.describe_ranks()[0]

    start_state = rank0()
    print(
        f"model {info.path.name}: {len(info.layer_types)} layers {sorted(set(info.layer_types))}, "
        f"{llm.config.parallel.tensor_parallel_size} rank(s) on {start_state['device']} "
        f"{start_state['dtype']}, {llm.engine.block_manager.num_blocks} KV blocks, "
        f"{len(start_state['graph_sizes'])} decode graphs"
    )
    header = (
        f"{'round':>5} {'tok/s':>10} {'tokens':>7} {'KV blocks used':>15} "
        f"{'capture s':>10} {'NaN rows':>9} {'same as round 1':>16}"
    )
    print(header)
    print("-" * len(header))
    first: list[list[int]] | None = None
    capture_s = start_state["capture_seconds"]
    all_same = all_nan_free = True
    for r in range(1, rounds + 1):
        if r > 1:
            capture_s = llm.recapture()
        llm.engine.peak_blocks_used = 0
        nan_before = rank0()["nan_rows"]
        start = time.perf_counter()
        outs = llm.generate(prompts, params)
        seconds = time.perf_counter() - start
        tokens = [o.token_ids for o in outs]
        first = first or tokens
        same = tokens == first
        all_same &= same
        n = sum(len(t) for t in tokens)
        blocks = f"{llm.engine.peak_blocks_used}/{llm.engine.block_manager.num_blocks}"
        nan_rows = rank0()["nan_rows"] - nan_before
        all_nan_free &= nan_rows == 0
        print(
            f"{r:>5} {n / seconds:>10.1f} {n:>7} {blocks:>15} {capture_s:>10.3f} "
            f"{nan_rows:>9} {'yes' if same else 'NO':>16}"
        )
    print(f"outputs identical across rounds: {'yes' if all_same else 'NO'}")
    llm.shutdown()
    return 0 if all_same and all_nan_free else 1
