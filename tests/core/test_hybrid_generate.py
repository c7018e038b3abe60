"""The hybrid Qwen3-Next model end to end: ``paged`` full attention + ``gdn`` linear attention.

Batched greedy generation matches transformers token for token in every way the
runner can schedule it; a recapture after serving leaves every pool (KV *and*
conv/recurrent state) byte-identical, and the same recapture without blanking
corrupts a GDN state pool; the embedded ``tiny-qwen3-next`` default serves and
rolls out.
"""

from __future__ import annotations

import shutil

import pytest
import torch

from kvrunner import LLM, SamplingParams
from kvrunner.cli import main as cli
from kvrunner.models.tiny import write_tiny_checkpoint
from kvrunner.plugin_api import PAD_SLOT_ID
from kvrunner.runner.capture.capture_safety import (
    CaptureAuditError,
    PoolSnapshot,
    blank_write_targets,
)

transformers = pytest.importorskip("transformers")

LAYER_TYPES = ["linear_attention", "full_attention", "linear_attention", "full_attention"]
SHARED = [3, 17, 29, 101, 55, 66, 77, 88, 99, 5, 6, 7, 8]
PROMPTS = [
    [3, 17, 29, 101],
    [7, 8, 9, 10, 11, 12, 13, 14, 15],
    [200],  # one token: a "decode-shaped" first step with no history
    SHARED,
    [200, 201],
    # Longer than a GDN chunk (64 tokens), and sharing 3 full blocks of 4 with SHARED, so a
    # prefix-cache hit would skip recurrent state the model needs.
    SHARED + [(31 * i) % 479 + 1 for i in range(60)],
]
NEW_TOKENS = 10
GREEDY = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
#: the longest request alone needs 21 blocks of 4; the batch needs more
PREEMPTING_BLOCKS = 22
BASE = dict(max_num_seqs=4, max_num_batched_tokens=96, max_model_len=96, num_blocks=64,
            block_size=4)  # fmt: skip


def save_hf_qwen3_next(path, *, seed: int) -> None:
    """A random transformers Qwen3-Next (dense MLPs) whose greedy outputs vary."""
    torch.manual_seed(seed)
    cfg = transformers.Qwen3NextConfig(
        vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
        layer_types=LAYER_TYPES, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
        linear_value_head_dim=16, linear_conv_kernel_dim=4, num_experts=0,
        max_position_embeddings=256, tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                         "partial_rotary_factor": 0.25},
    )  # fmt: skip
    model = transformers.Qwen3NextForCausalLM(cfg).eval()
    with torch.no_grad():  # HF initialises with small std and trivial norms/decays
        for name, p in model.named_parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.2)
            elif name.endswith("A_log"):
                p.copy_(torch.empty_like(p).uniform_(0.5, 4.0).log())
            else:  # dt_bias, zero-centred norms, the gated norm
                p.add_(0.3 * torch.randn_like(p))
    model.save_pretrained(path, safe_serialization=True)


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("hf") / "qwen3-next"
    save_hf_qwen3_next(path, seed=1)
    tiny = write_tiny_checkpoint(tmp_path_factory.mktemp("tok") / "t", kind="qwen3", seed=0)
    shutil.copy(tiny / "tokenizer.json", path / "tokenizer.json")
    return str(path)


@pytest.fixture(scope="module")
def hf_expected(hf_dir) -> list[list[int]]:
    """transformers' greedy continuation of each prompt alone (no padding)."""
    model = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    outs = []
    for prompt in PROMPTS:
        gen = model.generate(
            torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS,
            do_sample=False, eos_token_id=None, pad_token_id=0,
        )  # fmt: skip
        outs.append(gen[0, len(prompt) :].tolist())
    assert all(len(set(o)) > 1 for o in outs), "precondition: outputs are not degenerate"
    return outs


# -- generation parity ------------------------------------------------------------------


@pytest.mark.parametrize(
    "settings",
    [
        {"enforce_eager": True},
        {},  # decode through captured graphs (the eager stand-in on the CPU)
        {"max_num_batched_tokens": 8, "max_num_seqs": 3},  # chunked prefill, mixed batches
        # chunks shorter than the conv window: conv state must shift across steps
        {"max_num_batched_tokens": 3, "max_num_seqs": 2},
        {"block_size": 1, "num_blocks": 256},
        {"block_size": 16, "enable_prefix_caching": True},
        {"num_blocks": PREEMPTING_BLOCKS},  # preemption by recompute, slots re-taken
    ],
    ids=["eager", "graphs", "chunked", "chunked-3", "block1", "block16", "preempt"],
)
def test_batched_greedy_matches_transformers(hf_dir, hf_expected, settings) -> None:
    llm = LLM(model=hf_dir, **(BASE | settings))
    assert sorted(llm.runner.backends.names) == ["gdn", "paged"]
    # Recurrent state cannot be rebuilt from cached KV blocks: prefix caching is off.
    assert llm.engine.block_manager.enable_prefix_caching is False
    outs = llm.generate(PROMPTS, GREEDY)
    assert [o.token_ids for o in outs] == hf_expected
    assert llm.runner.launcher.nan_rows == 0
    if settings.get("num_blocks") == PREEMPTING_BLOCKS:
        assert llm.engine.scheduler.num_preemptions > 0, "precondition: something was preempted"


# -- capture safety ---------------------------------------------------------------------


def make_llm(model: str, **overrides) -> LLM:
    return LLM(model=model, **(BASE | {"max_num_batched_tokens": 64} | overrides))


def live_rows(llm: LLM, backend: str) -> int:
    targets = [t for t in llm.runner.backends.cache_write_targets() if t.backend == backend]
    assert targets, f"{backend} declares write targets"
    return sum(int((t.buffer >= 0).sum()) for t in targets)


def gdn_builder_only_target(llm: LLM):
    """The gdn write target that lives on its builder, outside forward_vars."""
    outside = [
        t
        for t in llm.runner.backends.cache_write_targets()
        if t.backend == "gdn" and not llm.runner.forward_vars.owns(t.buffer)
    ]
    assert len(outside) == 1, [t.name for t in outside]
    return outside[0]


SERVE = PROMPTS[:4]
SHORT = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)


def test_recapture_after_serving_leaves_kv_and_state_pools_byte_identical(hf_dir) -> None:
    llm = make_llm(hf_dir)
    llm.generate(SERVE, SHORT)
    assert live_rows(llm, "paged") > 0 and live_rows(llm, "gdn") > 0, (
        "precondition: both backends' write targets still point at live slots/rows"
    )
    outside = gdn_builder_only_target(llm)
    assert (outside.buffer != outside.pad_value).any(), "precondition: it holds live slots"
    pools = llm.runner.cache.pools
    assert any(n.startswith("gdn.ssm.") for n in pools) and any(
        n.startswith("gdn.conv.") for n in pools
    )
    assert any(pools[n].abs().sum() > 0 for n in pools if n.startswith("gdn.ssm."))
    snapshot = PoolSnapshot(pools)
    llm.recapture()
    assert snapshot.changed_pools() == []
    assert live_rows(llm, "paged") == 0 and live_rows(llm, "gdn") == 0
    assert (outside.buffer == PAD_SLOT_ID).all()


def test_without_blanking_the_same_recapture_corrupts_a_gdn_state_pool(hf_dir) -> None:
    llm = make_llm(hf_dir, blank_write_targets=False)
    llm.generate(SERVE, SHORT)
    snapshot = PoolSnapshot(llm.runner.cache.pools)
    llm.recapture()
    changed = snapshot.changed_pools()
    assert any(n.startswith(("gdn.ssm.", "gdn.conv.")) for n in changed), changed


def test_audit_mode_raises_on_that_corruption(hf_dir) -> None:
    llm = make_llm(hf_dir, blank_write_targets=False, audit=True)
    llm.generate(SERVE, SHORT)
    with pytest.raises(CaptureAuditError, match=r"gdn\.(ssm|conv)\."):
        llm.recapture()


@pytest.mark.parametrize("blank_gdn", [True, False], ids=["all-blanked", "gdn-not-blanked"])
def test_recapture_while_requests_are_live_keeps_their_state(
    hf_dir, hf_expected, blank_gdn
) -> None:
    """A recapture between two decode steps (a weight sync mid-rollout) must leave the
    running requests' KV and recurrent state alone. With only the paged targets blanked
    (by hand, core blanking off), GDN's live state indices alone corrupt the outputs."""
    llm = make_llm(hf_dir, blank_write_targets=blank_gdn)
    engine = llm.engine
    seqs = [engine.make_request(p, GREEDY, i) for i, p in enumerate(SERVE)]
    for seq in seqs:
        engine.add_request(seq)
    while min(len(s.output_token_ids) for s in seqs) < 3:
        engine.step()
    assert engine.has_unfinished(), "precondition: requests are mid-decode"
    assert live_rows(llm, "gdn") > 0
    if not blank_gdn:
        blank_write_targets(
            [t for t in llm.runner.backends.cache_write_targets() if t.backend == "paged"]
        )
    llm.recapture()
    while engine.has_unfinished():
        engine.step()
    same = [list(s.output_token_ids) for s in seqs] == hf_expected[: len(SERVE)]
    assert same is blank_gdn


def test_outputs_after_recapture_match_before(hf_dir, hf_expected) -> None:
    llm = make_llm(hf_dir, audit=True)
    before = [o.token_ids for o in llm.generate(SERVE, GREEDY)]
    llm.recapture()
    after = [o.token_ids for o in llm.generate(SERVE, GREEDY)]
    assert before == after == hf_expected[: len(SERVE)]


# -- the embedded default ---------------------------------------------------------------


def test_embedded_tiny_qwen3_next_serves_varied_greedy_text(kvrunner_home) -> None:
    llm = LLM(model="tiny-qwen3-next", max_num_seqs=4, max_model_len=64, num_blocks=32)
    assert llm.runner.model_path.is_relative_to(kvrunner_home)
    assert sorted(set(llm.runner.spec.layer_types)) == ["full_attention", "linear_attention"]
    prompts = ["the little engine", "a model reads one word", "the river"]
    outs = llm.generate(prompts, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
    for out in outs:
        assert len(out.token_ids) == 8
        assert len(set(out.token_ids)) > 2, f"degenerate greedy output {out.token_ids}"
    assert len({tuple(o.token_ids) for o in outs}) == len(prompts)
    # The written checkpoint is a faithful HF one: transformers continues it identically.
    hf = transformers.AutoModelForCausalLM.from_pretrained(llm.runner.model_path).eval()
    for out in outs:
        gen = hf.generate(
            torch.tensor([out.prompt_token_ids]), max_new_tokens=8, min_new_tokens=8,
            do_sample=False, eos_token_id=None, pad_token_id=0,
        )  # fmt: skip
        assert gen[0, len(out.prompt_token_ids) :].tolist() == out.token_ids


def test_rollout_cli_on_tiny_qwen3_next_repeats_itself(kvrunner_home, capsys) -> None:
    argv = ["rollout", "--model", "tiny-qwen3-next", "--rounds", "2", "--batch", "4",
            "--max-tokens", "8"]  # fmt: skip
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    assert "['full_attention', 'linear_attention']" in out
    assert "rounds that lost anything: none" in out
