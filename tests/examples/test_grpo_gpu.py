"""examples/grpo on CUDA in aligned mode: the engine samples in bf16 with deterministic
mode's kernels, the trainer's bf16 transformers policy runs on them, and every step's
rollout-vs-trainer logprob gap is exactly 0 while it trains and pushes its weights."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))

from grpo.loop import Settings, run  # noqa: E402

pytestmark = pytest.mark.gpu


def test_the_gpu_mode_trains_with_a_logprob_gap_of_zero() -> None:
    records = run(Settings(steps=5, device="cuda", shape="large", prompts_per_step=16,
                           group_size=8, seed=0, verbose=True))
    assert [r.step for r in records] == list(range(5))
    for r in records:
        assert r.gap_max == 0.0, (r.step, r.gap_mean, r.gap_max)
