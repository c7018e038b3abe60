"""Batched greedy generation matches Hugging Face transformers token for token."""

from __future__ import annotations

import shutil

import pytest
import torch

from kvrunner import LLM, SamplingParams
from kvrunner.models.tiny import write_tiny_checkpoint

transformers = pytest.importorskip("transformers")

PROMPTS = [
    [3, 17, 29, 101],
    [7, 8, 9, 10, 11, 12, 13, 14, 15],
    [200, 201],
    [3, 17, 29, 101, 55, 66, 77, 88, 99, 5, 6, 7, 8],
]
NEW_TOKENS = 10


def save_hf_qwen3(path, *, tie: bool, seed: int) -> None:
    torch.manual_seed(seed)
    cfg = transformers.Qwen3Config(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=256,
        tie_word_embeddings=tie,
        rope_theta=10000.0,
    )
    model = transformers.Qwen3ForCausalLM(cfg).eval()
    with torch.no_grad():  # HF initialises with small std; widen it so greedy outputs vary
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.2)
    model.save_pretrained(path, safe_serialization=True)


@pytest.fixture(scope="module", params=[False, True], ids=["untied", "tied"])
def hf_dir(request, tmp_path_factory):
    path = tmp_path_factory.mktemp("hf") / "qwen3"
    save_hf_qwen3(path, tie=request.param, seed=1)
    tiny = write_tiny_checkpoint(tmp_path_factory.mktemp("tok") / "t", kind="qwen3", seed=0)
    shutil.copy(tiny / "tokenizer.json", path / "tokenizer.json")
    return path


def hf_greedy(path) -> list[list[int]]:
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    outs = []
    for prompt in PROMPTS:
        ids = torch.tensor([prompt])
        gen = model.generate(
            ids,
            max_new_tokens=NEW_TOKENS,
            min_new_tokens=NEW_TOKENS,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )
        outs.append(gen[0, len(prompt) :].tolist())
    return outs


@pytest.mark.parametrize(
    "settings",
    [
        {"enforce_eager": True},
        {},  # decode through captured graphs (the eager stand-in on the CPU)
        {"max_num_batched_tokens": 8, "max_num_seqs": 3},  # chunked prefill, mixed batches
        {"block_size": 1},
        {"block_size": 16, "enable_prefix_caching": True},
    ],
    ids=["eager", "graphs", "chunked", "block1", "block16"],
)
def test_batched_greedy_matches_transformers(hf_dir, settings) -> None:
    expected = hf_greedy(hf_dir)
    base = dict(
        max_num_seqs=4, max_num_batched_tokens=64, max_model_len=64, num_blocks=64, block_size=4
    )
    llm = LLM(model=str(hf_dir), **(base | settings))
    outs = llm.generate(
        PROMPTS, SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    )
    assert [o.token_ids for o in outs] == expected
