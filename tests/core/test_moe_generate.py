"""Mixture-of-experts models end to end: batched greedy generation through ``LLM``
matches transformers token for token.

Tiny random Qwen3-MoE and sparse Qwen3-Next checkpoints written by transformers
(odd expert counts, top-k > 1 and top-k = number of experts, ``norm_topk_prob``
both ways, a dense layer among sparse ones), served eagerly, through captured decode
graphs (the eager stand-in on the CPU), with chunked prefill, and split over two
ranks on gloo. Also: the embedded tiny MoE defaults serve, and a weight push by
per-expert Hugging Face names equals a fresh engine on the pushed checkpoint.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from kvrunner import LLM, SamplingParams
from kvrunner.layers.moe import SparseMoeBlock
from kvrunner.models.loader import iter_safetensors
from kvrunner.models.tiny import write_tiny_checkpoint
from kvrunner.testing.moe_checkpoints import save_hf_qwen3_moe, save_hf_qwen3_next_moe

transformers = pytest.importorskip("transformers")

PROMPTS = [
    [3, 17, 29, 101],
    [7, 8, 9, 10, 11, 12, 13, 14, 15],
    [200],
    [3, 17, 29, 101, 55, 66, 77, 88, 99, 5, 6, 7, 8],
]
NEW_TOKENS = 10
GREEDY = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
BASE = dict(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=64, num_blocks=64,
            block_size=4)  # fmt: skip

MODELS = {
    "qwen3-moe-5e-top2-renorm": (save_hf_qwen3_moe, dict(
        num_experts=5, num_experts_per_tok=2, norm_topk_prob=True)),
    "qwen3-moe-3e-top3-raw-dense0": (save_hf_qwen3_moe, dict(
        num_experts=3, num_experts_per_tok=3, norm_topk_prob=False, mlp_only_layers=[0])),
    "next-moe-5e-top2-renorm": (save_hf_qwen3_next_moe, dict(
        num_experts=5, num_experts_per_tok=2, norm_topk_prob=True)),
    "next-moe-7e-top3-raw": (save_hf_qwen3_next_moe, dict(
        num_experts=7, num_experts_per_tok=3, norm_topk_prob=False)),
}  # fmt: skip


@pytest.fixture(scope="module", params=list(MODELS), ids=list(MODELS))
def hf_case(request, tmp_path_factory) -> tuple[str, list[list[int]]]:
    """A transformers MoE checkpoint and transformers' greedy continuation of each prompt."""
    writer, overrides = MODELS[request.param]
    path = tmp_path_factory.mktemp("hf") / request.param
    model = writer(path, seed=1, **overrides)
    tiny = write_tiny_checkpoint(tmp_path_factory.mktemp("tok") / "t", kind="qwen3", seed=0)
    shutil.copy(tiny / "tokenizer.json", path / "tokenizer.json")
    outs = []
    with torch.no_grad():
        for prompt in PROMPTS:
            gen = model.generate(
                torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS,
                do_sample=False, eos_token_id=None, pad_token_id=0,
            )  # fmt: skip
            outs.append(gen[0, len(prompt) :].tolist())
    assert all(len(set(o)) > 1 for o in outs), "precondition: outputs are not degenerate"
    return str(path), outs


@pytest.mark.parametrize(
    "settings",
    [
        {"enforce_eager": True},
        {},  # decode through captured graphs (the eager stand-in on the CPU)
        {"max_num_batched_tokens": 8, "max_num_seqs": 3},  # chunked prefill, mixed batches
        {"tensor_parallel_size": 2, "enforce_eager": True},
        {"tensor_parallel_size": 2},  # each rank half of every expert, graphs captured
    ],
    ids=["eager", "graphs", "chunked", "tp2-eager", "tp2-graphs"],
)
def test_batched_greedy_matches_transformers(hf_case, settings) -> None:
    path, expected = hf_case
    with LLM(model=path, **(BASE | settings)) as llm:
        outs = llm.generate(PROMPTS, GREEDY)
    assert [o.token_ids for o in outs] == expected


@pytest.mark.parametrize("kind", ["qwen3-moe", "qwen3-next-moe"])
def test_the_embedded_tiny_moe_defaults_serve(kind: str) -> None:
    with LLM(model=f"tiny-{kind}", max_num_seqs=4, max_model_len=64, num_blocks=32) as llm:
        sparse = [m for m in llm.runner.model.modules() if isinstance(m, SparseMoeBlock)]
        assert len(sparse) == llm.runner.model.config.num_hidden_layers
        assert (sparse[0].shared_expert is not None) == (kind == "qwen3-next-moe")
        outs = llm.generate(PROMPTS, GREEDY)
    assert all(len(o.token_ids) == NEW_TOKENS for o in outs)
    assert len({tuple(o.token_ids) for o in outs}) > 1


@pytest.mark.parametrize("kind", ["qwen3-moe", "qwen3-next-moe"])
def test_a_push_by_per_expert_names_equals_a_fresh_engine(tmp_path: Path, kind: str) -> None:
    served = write_tiny_checkpoint(tmp_path / "a", kind=kind, seed=0)
    pushed = write_tiny_checkpoint(tmp_path / "b", kind=kind, seed=1)
    settings = dict(max_num_seqs=4, max_model_len=64, num_blocks=32, block_size=4)
    with LLM(model=str(pushed), **settings) as fresh:
        want = [o.token_ids for o in fresh.generate(PROMPTS, GREEDY)]
    with LLM(model=str(served), **settings) as llm:
        before = [o.token_ids for o in llm.generate(PROMPTS, GREEDY)]
        assert before != want, "precondition: the two checkpoints answer differently"
        experts = [(n, t) for n, t in iter_safetensors(pushed, torch.float32) if ".experts." in n]
        assert experts and all(n.endswith(("gate_proj.weight", "up_proj.weight",
                                           "down_proj.weight")) for n, _ in experts)
        llm.update_weights(iter_safetensors(pushed, torch.float32))
        assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY)] == want


def test_expert_weights_count_as_weights_and_a_level_2_sleep_frees_them() -> None:
    with LLM(model="tiny-qwen3-next-moe", max_num_seqs=4, max_model_len=64,
             num_blocks=32) as llm:
        before = [o.token_ids for o in llm.generate(PROMPTS, GREEDY)]
        model = llm.runner.model
        experts = [m.experts for m in model.modules() if isinstance(m, SparseMoeBlock)]
        expert_bytes = sum(e.w13.nbytes + e.w2.nbytes for e in experts)
        weight_bytes = llm.cache_info().ranks[0].weight_bytes
        assert weight_bytes == sum(p.nbytes for p in model.parameters()) + sum(
            b.nbytes for b in model.buffers())
        assert expert_bytes > weight_bytes / 3, "precondition: the experts weigh"
        llm.sleep(2)
        assert all(e.w13.untyped_storage().nbytes() == 0 for e in experts)
        assert llm.cache_info().last_freed_bytes >= weight_bytes
        llm.wake_up()
        assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY)] == before


def test_a_push_of_transformers_stacked_experts_equals_a_fresh_engine(tmp_path: Path) -> None:
    """A trainer on transformers 5 holds each layer's experts stacked
    (``mlp.experts.gate_up_proj`` [E, 2I, H], ``mlp.experts.down_proj`` [E, H, I]) and
    pushes its parameters under those names; each stands for its per-expert tensors."""
    served, pushed = tmp_path / "a", tmp_path / "b"
    save_hf_qwen3_moe(served, seed=1)
    trainer = save_hf_qwen3_moe(pushed, seed=2)
    for path in (served, pushed):
        shutil.copy(write_tiny_checkpoint(tmp_path / "tok", seed=0) / "tokenizer.json", path)
    names = dict(trainer.named_parameters())
    assert "model.layers.0.mlp.experts.gate_up_proj" in names, "precondition: stacked names"
    with LLM(model=str(pushed), **BASE) as fresh:
        want = [o.token_ids for o in fresh.generate(PROMPTS, GREEDY)]
    with LLM(model=str(served), **BASE) as llm:
        assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY)] != want
        llm.sleep(2, discard_weights=True)
        llm.wake_up(["weights"])
        llm.update_weights((n, p.detach()) for n, p in trainer.named_parameters())
        llm.wake_up(["kv_cache"])  # serves only if every per-expert tensor counts as pushed
        assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY)] == want


SEEDED = SamplingParams(max_tokens=6, temperature=1.0, top_p=0.9, seed=11, logprobs=2,
                        ignore_eos=True)


@pytest.mark.parametrize("kind", ["qwen3-moe", "qwen3-next-moe"])
def test_two_ranks_sample_and_score_as_one(kind: str) -> None:
    """Seeded sampling and logprobs at TP=2 (each rank half of every expert, one
    all-reduce per block) equal TP=1's."""
    settings = dict(model=f"tiny-{kind}", max_num_seqs=4, max_model_len=64, num_blocks=32)
    with LLM(**settings, enforce_eager=True) as one:
        want = one.generate(PROMPTS, SEEDED)
    with LLM(**settings, tensor_parallel_size=2) as two:
        got = two.generate(PROMPTS, SEEDED)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    for a, b in zip(got, want, strict=True):
        assert a.logprobs == pytest.approx(b.logprobs, abs=1e-4)
