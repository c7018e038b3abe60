"""A capture writes nothing outside PAD — and each check here can fail.

Serving a batch leaves forward_vars holding live slots; recapturing then runs the
model for real. With blanking the pools stay byte-identical; with blanking switched
off the very same sequence corrupts them, and the audit names it.
"""

from __future__ import annotations

import pytest

from kvrunner import LLM, SamplingParams
from kvrunner.models.tiny import write_tiny_checkpoint
from kvrunner.runner.capture import capture_audit
from kvrunner.runner.capture.capture_safety import CaptureAuditError, PoolSnapshot

PROMPTS = [[5, 6, 7, 8, 9], [10, 11, 12], [13, 14, 15, 16, 17, 18, 19]]
GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny_qwen3(tmp_path_factory) -> str:
    return str(
        write_tiny_checkpoint(tmp_path_factory.mktemp("ckpt") / "tiny-qwen3", kind="qwen3", seed=0)
    )


def make_llm(model: str, **overrides) -> LLM:
    settings = dict(
        max_num_seqs=4, max_num_batched_tokens=64, max_model_len=96, block_size=4, num_blocks=48
    )
    return LLM(model=model, **(settings | overrides))


def live_write_rows(llm: LLM) -> int:
    return sum(int((t.buffer >= 0).sum()) for t in llm.runner.backends.cache_write_targets())


def test_recapture_after_serving_leaves_every_pool_byte_identical(tiny_qwen3) -> None:
    llm = make_llm(tiny_qwen3)
    llm.generate(PROMPTS, GREEDY)
    assert live_write_rows(llm) > 0, "precondition: write targets still point at live slots"
    snapshot = PoolSnapshot(llm.runner.cache.pools)
    llm.recapture()
    assert snapshot.changed_pools() == []
    assert live_write_rows(llm) == 0


def test_without_blanking_the_same_recapture_corrupts_the_cache(tiny_qwen3) -> None:
    llm = make_llm(tiny_qwen3, blank_write_targets=False)
    llm.generate(PROMPTS, GREEDY)
    snapshot = PoolSnapshot(llm.runner.cache.pools)
    llm.recapture()
    assert snapshot.changed_pools() != []


def test_audit_mode_raises_on_that_corruption(tiny_qwen3) -> None:
    llm = make_llm(tiny_qwen3, blank_write_targets=False, audit=True)
    llm.generate(PROMPTS, GREEDY)
    with pytest.raises(CaptureAuditError, match="paged.kv"):
        llm.recapture()


def test_audit_catches_an_undeclared_write_target_at_the_very_first_capture(
    tiny_qwen3, flatkv_installed
) -> None:
    # The leaky backend's slot_mapping holds PAD at start-up, so only the audit's
    # seeding of undeclared index buffers (what serving would leave) exposes it.
    with pytest.raises(CaptureAuditError, match="leaky.kv"):
        make_llm(tiny_qwen3, full_attention="leaky", audit=True)


def test_without_seeding_the_start_up_audit_is_blind_to_it(
    tiny_qwen3, flatkv_installed, monkeypatch
) -> None:
    monkeypatch.setattr(capture_audit, "seed_undeclared_index_buffers", lambda *a, **k: [])
    llm = make_llm(tiny_qwen3, full_attention="leaky", audit=True)  # passes: the blind spot
    llm.generate(PROMPTS, GREEDY)
    with pytest.raises(CaptureAuditError, match="leaky.kv"):
        llm.recapture()  # ... until live rows are left behind


def test_declaring_the_buffer_makes_the_same_backend_safe(tiny_qwen3, flatkv_installed) -> None:
    llm = make_llm(tiny_qwen3, full_attention="flatkv", audit=True)
    first = [o.token_ids for o in llm.generate(PROMPTS, GREEDY)]
    llm.recapture()
    assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY)] == first


def test_outputs_after_recapture_match_before_and_match_eager(tiny_qwen3) -> None:
    llm = make_llm(tiny_qwen3, audit=True)
    before = [o.token_ids for o in llm.generate(PROMPTS, GREEDY)]
    llm.recapture()
    after = [o.token_ids for o in llm.generate(PROMPTS, GREEDY)]
    eager = [
        o.token_ids for o in make_llm(tiny_qwen3, enforce_eager=True).generate(PROMPTS, GREEDY)
    ]
    assert before == after == eager
    assert llm.runner.launcher.nan_rows == 0
