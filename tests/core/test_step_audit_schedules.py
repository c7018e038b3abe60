"""The step audit raises no false alarm on the built-in backends: paged, gdn beside
paged (the hybrid model), and tbo over both, across any schedule of prompts with
shared prefixes (prefix-cache hits), long prompts in chunks, more work than the pool
holds (preemption), sleep / wake and weight pushes. Every step is audited, and the
audited engine's greedy tokens are an unaudited engine's.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvrunner import LLM, SamplingParams
from kvrunner.models.loader import iter_safetensors
from kvrunner.models.tiny import write_tiny_checkpoint

#: a small pool and step budget: a long prompt comes in chunks, a wide batch preempts
ENGINE = dict(max_num_seqs=4, max_num_batched_tokens=16, max_model_len=64, block_size=4,
              num_blocks=24, capture_sizes=(1, 2, 4))
#: tbo splits every step it can
TBO = dict(overlap="tbo", overlap_min_tokens=2, overlap_min_decode_seqs=2)
CASES = {
    "paged": ("qwen3", {}),
    "paged+tbo": ("qwen3", TBO),
    "gdn+paged": ("qwen3-next", {}),
    "gdn+paged+tbo": ("qwen3-next", TBO),
}

prompt = st.lists(st.integers(5, 60), min_size=1, max_size=30)
#: a batch: prompts, some sharing the first one's prefix
batch = st.tuples(prompt, st.lists(st.tuples(st.integers(0, 30), prompt), max_size=4))
operation = st.one_of(
    st.tuples(st.just("generate"), batch, st.integers(1, 6)),
    st.tuples(st.just("sleep"), st.sampled_from([1, 2])),
    st.tuples(st.just("push")),
)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("audit")
    return {kind: str(write_tiny_checkpoint(root / kind, kind=kind, seed=0))
            for kind in ("qwen3", "qwen3-next")}


def prompts_of(drawn: tuple[list[int], list[tuple[int, list[int]]]]) -> list[list[int]]:
    first, others = drawn
    return [first] + [first[:shared] + rest for shared, rest in others]


@pytest.mark.parametrize("case", sorted(CASES))
def test_no_step_of_any_schedule_raises_a_false_alarm(checkpoints, case: str) -> None:
    kind, extra = CASES[case]
    audited = LLM(model=checkpoints[kind], audit=True, **ENGINE, **extra)
    plain = LLM(model=checkpoints[kind], **ENGINE, **extra)
    weights = list(iter_safetensors(Path(checkpoints[kind]), torch.float32))

    @settings(max_examples=10, deadline=None, database=None,
              suppress_health_check=list(HealthCheck))
    @given(st.lists(operation, min_size=1, max_size=5))
    def schedule(ops: list[tuple]) -> None:
        for op in ops:
            if op[0] == "generate":
                greedy = SamplingParams(max_tokens=op[2], temperature=0.0, ignore_eos=True)
                prompts = prompts_of(op[1])
                got = [o.token_ids for o in audited.generate(prompts, greedy)]
                assert got == [o.token_ids for o in plain.generate(prompts, greedy)]
            elif op[0] == "sleep":
                audited.sleep(op[1], discard_weights=op[1] == 2)
                audited.wake_up()
                if op[1] == 2:  # the weights were discarded: push them back
                    audited.update_weights(weights)
            else:
                audited.update_weights(weights)

    before = audited.runner.launcher.audit.steps
    schedule()
    assert audited.runner.launcher.audit.steps > before
