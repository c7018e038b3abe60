"""The step audit on CUDA: real graphs, the Triton row checksums. A correct backend's
steps raise nothing and give the unaudited tokens; each step mutant is named at its
first step."""

from __future__ import annotations

import pytest
from mutants import STEP_MUTANTS

from kvrunner import LLM, SamplingParams
from kvrunner.plugin_host.plugins import register_backend, unregister_backend
from kvrunner.runner.step.step_audit import StepAuditError

pytestmark = pytest.mark.gpu

PROMPTS = [[5, 6, 7, 8, 9], [10, 11, 12], [13, 14, 15, 16, 17, 18, 19]]
GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
SETTINGS = dict(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=96, block_size=4,
                num_blocks=48, dtype="bfloat16")


def test_a_correct_backend_passes_every_audited_step_on_cuda(tiny_qwen3) -> None:
    audited = LLM(model=tiny_qwen3, audit=True, **SETTINGS)
    plain = LLM(model=tiny_qwen3, **SETTINGS)
    got = [o.token_ids for o in audited.generate(PROMPTS, GREEDY)]
    assert got == [o.token_ids for o in plain.generate(PROMPTS, GREEDY)]
    assert audited.runner.launcher.audit.steps >= GREEDY.max_tokens


#: the stale tail writes nothing on CUDA: a decode step stores its keys in the attention
#: kernel, which runs no program for a padded row (its tokens are paged's: the test below)
WRITING_ON_CUDA = sorted(set(STEP_MUTANTS) - {"mutant-no-tail-pad"})


def test_a_stale_tail_writes_nothing_on_cuda(tiny_qwen3) -> None:
    name = "mutant-no-tail-pad"
    register_backend(name, STEP_MUTANTS[name])
    try:
        llm = LLM(model=tiny_qwen3, full_attention=name, audit=True, **SETTINGS)
        got = [o.token_ids for o in llm.generate(PROMPTS, GREEDY)]
    finally:
        unregister_backend(name)
    plain = LLM(model=tiny_qwen3, **SETTINGS)
    assert got == [o.token_ids for o in plain.generate(PROMPTS, GREEDY)]


@pytest.mark.parametrize("name", WRITING_ON_CUDA)
def test_each_step_mutant_is_named_at_its_step_on_cuda(tiny_qwen3, name: str) -> None:
    register_backend(name, STEP_MUTANTS[name])
    try:
        llm = LLM(model=tiny_qwen3, full_attention=name, audit=True, **SETTINGS)
        with pytest.raises(StepAuditError, match=f"backend {name!r}: a step wrote layer"):
            llm.generate(PROMPTS, GREEDY)
    finally:
        unregister_backend(name)
