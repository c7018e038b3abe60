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
    runner = llm.runner
    runner.progress = False  # keep the table readable: bars only while loading
    print(
        f"model {runner.model_path.name}: {runner.spec.num_layers} layers "
        f"{sorted(set(runner.spec.layer_types))}, backends {llm.runner.backends.names}, "
        f"{runner.device} {str(runner.dtype).removeprefix('torch.')}, "
        f"{runner.num_blocks} KV blocks, {len(runner.graphs)} decode graphs"
    )
    header = (
        f"{'round':>5} {'tok/s':>10} {'tokens':>7} {'KV blocks used':>15} "
        f"{'capture s':>10} {'NaN rows':>9} {'same as round 1':>16}"
    )
    print(header)
    print("-" * len(header))
    first: list[list[int]] | None = None
    capture_s = runner.capture_seconds
    all_same = True
    for r in range(1, rounds + 1):
        if r > 1:
            capture_s = llm.recapture()
        llm.engine.peak_blocks_used = 0
        nan_before = runner.nan_rows
        start = time.perf_counter()
        outs = llm.generate(prompts, params)
        seconds = time.perf_counter() - start
        tokens = [o.token_ids for o in outs]
        first = first or tokens
        same = tokens == first
        all_same &= same
        n = sum(len(t) for t in tokens)
        blocks = f"{llm.engine.peak_blocks_used}/{runner.num_blocks}"
        print(
            f"{r:>5} {n / seconds:>10.1f} {n:>7} {blocks:>15} {capture_s:>10.3f} "
            f"{runner.nan_rows - nan_before:>9} {'yes' if same else 'NO':>16}"
        )
    print(f"outputs identical across rounds: {'yes' if all_same else 'NO'}")
    return 0 if all_same and runner.nan_rows == 0 else 1
