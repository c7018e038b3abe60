"""Checkpoints as transformers and tokenizers write them load and generate as transformers does.

Every file here is written by the libraries themselves (``save_pretrained`` of a
model, of a sharded model, of a ``PreTrainedTokenizerFast``, of a
``GenerationConfig``), and every output is compared with transformers' own greedy
generation on the same files.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from kvrunner import LLM, RequestError, SamplingParams
from kvrunner.models.tiny import build_tokenizer

transformers = pytest.importorskip("transformers")

PROMPTS = [[3, 17, 29, 101], [7, 8, 9, 10, 11, 12, 13, 14, 15], [200, 201]]
NEW_TOKENS = 8
ENGINE = dict(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=64, num_blocks=64,
              block_size=4, enforce_eager=True)
SPECIALS = ["<|im_start|>", "<|im_end|>"]


def random_qwen3(seed: int = 1, vocab_size: int = 512) -> transformers.Qwen3ForCausalLM:
    """A small transformers Qwen3 with weights wide enough that greedy outputs vary."""
    torch.manual_seed(seed)
    cfg = transformers.Qwen3Config(
        vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
        tie_word_embeddings=False, eos_token_id=None, bos_token_id=None, pad_token_id=None,
    )
    model = transformers.Qwen3ForCausalLM(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.2)
    return model


def hf_greedy(path: Path, prompts: list[list[int]], *, stop_at_eos: bool) -> list[list[int]]:
    """transformers' greedy continuation of each prompt, read back from ``path``."""
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    outs = []
    for prompt in prompts:
        extra = {} if stop_at_eos else {"eos_token_id": None, "min_new_tokens": NEW_TOKENS}
        gen = model.generate(torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, do_sample=False,
                             pad_token_id=0, **extra)
        outs.append(gen[0, len(prompt):].tolist())
    return outs


@pytest.fixture(scope="module")
def bare(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A model as a trainer saves it: config.json and safetensors, no tokenizer."""
    path = tmp_path_factory.mktemp("bare") / "m"
    random_qwen3().save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def bare_greedy(bare: Path) -> list[list[int]]:
    return hf_greedy(bare, PROMPTS, stop_at_eos=False)


GREEDY = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)


def test_a_model_saved_without_tokenizer_generates_as_transformers(bare, bare_greedy) -> None:
    assert not (bare / "tokenizer.json").exists()
    with LLM(str(bare), **ENGINE) as llm:
        outs = llm.generate(PROMPTS, GREEDY)
    assert [o.token_ids for o in outs] == bare_greedy
    assert all(o.text == "" for o in outs)  # no tokenizer: no text, documented


def test_a_text_prompt_without_tokenizer_is_refused_naming_the_cause(bare) -> None:
    with LLM(str(bare), **ENGINE) as llm, pytest.raises(RequestError) as info:
        llm.generate(["hello"], GREEDY)
    assert "request 0" in str(info.value) and "no tokenizer" in str(info.value)


def test_skip_tokenizer_init_refuses_text_even_with_a_tokenizer(tmp_path: Path) -> None:
    with LLM("tiny-qwen3", skip_tokenizer_init=True, **ENGINE) as llm:
        assert llm.tokenizer is None
        assert len(llm.generate([[1, 2, 3]], GREEDY)[0].token_ids) == NEW_TOKENS
        with pytest.raises(RequestError, match="no tokenizer"):
            llm.generate("hello", GREEDY)


def test_a_model_without_tokenizer_loads_at_tensor_parallel_2(bare, bare_greedy) -> None:
    with LLM(str(bare), tensor_parallel_size=2, **ENGINE) as llm:
        outs = llm.generate(PROMPTS, GREEDY)
        with pytest.raises(RequestError, match="no tokenizer"):
            llm.generate("hello", GREEDY)
    assert [o.token_ids for o in outs] == bare_greedy


def test_a_sharded_checkpoint_loads_exactly_the_shards_its_index_names(
    bare_greedy, tmp_path: Path
) -> None:
    path = tmp_path / "sharded"
    random_qwen3().save_pretrained(path, max_shard_size="100KB")
    index = json.loads((path / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) >= 2
    # A stray file beside the shards (a leftover of an earlier save) is not part of it.
    save_file({"stale.weight": torch.zeros(2)}, str(path / "leftover.safetensors"))
    with LLM(str(path), **ENGINE) as llm:
        outs = llm.generate(PROMPTS, GREEDY)
    assert [o.token_ids for o in outs] == bare_greedy


def save_chat_tokenizer(path: Path) -> transformers.PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer with added special tokens, saved by transformers
    (tokenizer.json, tokenizer_config.json, special tokens)."""
    hf_tok = transformers.PreTrainedTokenizerFast(
        tokenizer_object=build_tokenizer(), eos_token="<|endoftext|>",
        additional_special_tokens=SPECIALS,
    )
    hf_tok.save_pretrained(path)
    return transformers.AutoTokenizer.from_pretrained(path)


def test_special_tokens_and_a_generation_config_eos_list_work_as_in_transformers(
    tmp_path: Path,
) -> None:
    path = tmp_path / "chat"
    model = random_qwen3(seed=4)
    model.save_pretrained(path)
    hf_tok = save_chat_tokenizer(path)
    assert (path / "tokenizer_config.json").exists()
    text = "<|im_start|>the engine reads the river<|im_end|>"
    ids = hf_tok(text)["input_ids"]
    im_start, im_end = (hf_tok.convert_tokens_to_ids(t) for t in SPECIALS)
    assert ids[0] == im_start and ids[-1] == im_end  # each special token is one id
    # Make a token the model does emit an end-of-sequence token, next to <|im_end|>.
    free = hf_greedy(path, [ids], stop_at_eos=False)[0]
    stop = next(t for k, t in enumerate(free) if k >= 2 and t not in free[:k])
    transformers.GenerationConfig(eos_token_id=[im_end, stop]).save_pretrained(path)
    expected = hf_greedy(path, [ids], stop_at_eos=True)[0]
    assert expected[-1] == stop and len(expected) < NEW_TOKENS

    with LLM(str(path), **ENGINE) as llm:
        out = llm.generate(text, SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0))[0]
    assert out.prompt_token_ids == ids
    assert out.token_ids == expected and out.finish_reason == "stop"
    assert out.text == hf_tok.decode(expected, skip_special_tokens=True)
