"""The tiny random checkpoint writer and the built-in default models."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
import torch
import transformers
from hypothesis import given
from hypothesis import strategies as st

from kvrunner.errors import ConfigError
from kvrunner.models import tiny
from kvrunner.models.loader import load_model
from kvrunner.models.tiny import (
    EOS_TOKEN,
    build_tokenizer,
    ensure_default_model,
    temp_prefix,
    write_tiny_checkpoint,
)

FILES = ["config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
         "tokenizer_config.json"]


def no_layer(layer_index: int, layer_type: str) -> object:
    return object()


def files_of(path: Path) -> dict[str, bytes]:
    return {f.name: f.read_bytes() for f in sorted(path.iterdir())}


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_checkpoint(tmp_path_factory.mktemp("tiny") / "a", seed=0)


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer()


def test_same_seed_same_bytes_other_seed_other_weights(ckpt: Path, tmp_path: Path) -> None:
    again = files_of(write_tiny_checkpoint(tmp_path / "b", seed=0))
    other = files_of(write_tiny_checkpoint(tmp_path / "c", seed=1))
    assert sorted(again) == FILES
    assert again == files_of(ckpt)
    assert other["model.safetensors"] != again["model.safetensors"]
    assert other["tokenizer.json"] == again["tokenizer.json"]


def test_tokenizer_training_is_deterministic(tokenizer) -> None:
    assert build_tokenizer().to_str() == tokenizer.to_str()
    assert 400 <= tokenizer.get_vocab_size() <= 512
    assert tokenizer.token_to_id(EOS_TOKEN) is not None


@given(st.text(max_size=60))
def test_tokenizer_round_trips_any_text(tokenizer, text: str) -> None:
    assert tokenizer.decode(tokenizer.encode(text).ids) == text


def test_trained_merges_compress_english(tokenizer) -> None:
    text = "The little engine counted the wagons in the garden."
    assert len(tokenizer.encode(text).ids) < len(text.encode()) / 2


def test_loads_through_load_model(ckpt: Path, tokenizer) -> None:
    model, tok, config = load_model(ckpt, dtype="auto", device="cpu", make_layer=no_layer)
    assert tok.to_str() == tokenizer.to_str()
    assert config.vocab_size % 64 == 0 and config.vocab_size >= tok.get_vocab_size()
    assert config.eos_token_id == (tok.token_to_id(EOS_TOKEN),)
    assert (config.hidden_size, config.num_hidden_layers, config.head_dim) == (64, 2, 16)
    assert (config.num_attention_heads, config.num_key_value_heads) == (4, 2)
    assert model.model.embed_tokens.weight.dtype == torch.float32


def test_transformers_loads_it_and_greedy_is_not_degenerate(ckpt: Path, tokenizer) -> None:
    """The checkpoint is real HF format, and a greedy continuation moves around."""
    hf = transformers.Qwen3ForCausalLM.from_pretrained(ckpt).eval()
    for prompt in ["The river was", "A model reads one word"]:
        ids = tokenizer.encode(prompt).ids
        with torch.no_grad():
            for _ in range(16):
                ids.append(int(hf(torch.tensor([ids])).logits[0, -1].argmax()))
        generated = ids[-16:]
        assert len(set(generated)) >= 5, generated
        assert len(set(generated[-6:])) > 1, generated


@pytest.fixture
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("KVRUNNER_HOME", str(tmp_path))
    return tmp_path


@pytest.fixture
def writes(monkeypatch: pytest.MonkeyPatch) -> list[Path]:
    """Count the default writer's calls (the real writer still runs)."""
    calls: list[Path] = []
    real = tiny.DEFAULT_MODELS["tiny-qwen3"]

    def counting(path: Path) -> None:
        calls.append(path)
        real(path)

    monkeypatch.setitem(tiny.DEFAULT_MODELS, "tiny-qwen3", counting)
    return calls


def test_default_model_is_written_once_then_reused(home: Path, writes: list, ckpt: Path) -> None:
    path = ensure_default_model("tiny-qwen3")
    assert path == home / "models" / "tiny-qwen3"
    assert files_of(path) == files_of(ckpt)
    marker = path / "config.json"
    stamp = marker.stat().st_mtime_ns
    assert ensure_default_model("tiny-qwen3") == path
    assert len(writes) == 1 and marker.stat().st_mtime_ns == stamp
    assert [p.name for p in (home / "models").iterdir()] == ["tiny-qwen3"]  # no temp left


def test_stale_temp_of_a_dead_writer_is_cleaned_up(home: Path, writes: list) -> None:
    dead = subprocess.Popen(["true"])
    dead.wait()
    stale = home / "models" / f"{temp_prefix('tiny-qwen3')}{dead.pid}-0000"
    stale.mkdir(parents=True)
    (stale / "config.json").write_text("{half")
    in_progress = home / "models" / f"{temp_prefix('tiny-qwen3')}{os.getpid()}-live"
    in_progress.mkdir()
    path = ensure_default_model("tiny-qwen3")
    assert not stale.exists()
    assert in_progress.exists()  # a live writer's temp is not touched
    assert len(writes) == 1 and (path / "model.safetensors").exists()


def test_crashed_writer_leaves_nothing_and_a_retry_works(
    home: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def crash(path: Path) -> None:
        (path / "config.json").write_text("{}")
        raise OSError("disk full")

    monkeypatch.setitem(tiny.DEFAULT_MODELS, "tiny-qwen3", crash)
    with pytest.raises(ConfigError, match="disk full"):  # one line naming the home
        ensure_default_model("tiny-qwen3")
    assert list((home / "models").iterdir()) == []
    monkeypatch.undo()
    assert (ensure_default_model("tiny-qwen3") / "model.safetensors").exists()


def test_losing_a_concurrent_first_use_keeps_the_winner(
    home: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    dest = home / "models" / "tiny-qwen3"

    def racing(path: Path) -> None:
        write_tiny_checkpoint(dest, seed=0)  # another process finishes first
        write_tiny_checkpoint(path, seed=0)

    monkeypatch.setitem(tiny.DEFAULT_MODELS, "tiny-qwen3", racing)
    assert ensure_default_model("tiny-qwen3") == dest
    assert [p.name for p in (home / "models").iterdir()] == ["tiny-qwen3"]


def test_unknown_default_lists_known(home: Path) -> None:
    with pytest.raises(ValueError, match="tiny-qwen3"):
        ensure_default_model("tiny-llama")
