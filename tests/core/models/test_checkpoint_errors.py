"""A corrupt or partial checkpoint is one CheckpointError naming the file and the fault."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest

from kvrunner import LLM, CheckpointError, ConfigError
from kvrunner.models.loader import load_hf_config, load_model
from kvrunner.models.tiny import write_tiny_checkpoint
from kvrunner.plugin_api import KvrunnerError

ENGINE = dict(max_num_seqs=2, max_model_len=32, num_blocks=8, enforce_eager=True)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_checkpoint(tmp_path_factory.mktemp("tiny") / "ckpt")


def broken_copy(tiny: Path, dst: Path, damage: Callable[[Path], None]) -> Path:
    shutil.copytree(tiny, dst)
    damage(dst)
    return dst


def truncate(name: str, keep: float) -> Callable[[Path], None]:
    def damage(path: Path) -> None:
        data = (path / name).read_bytes()
        (path / name).write_bytes(data[: int(len(data) * keep)])

    return damage


def bad_safetensors_header(path: Path) -> None:
    data = bytearray((path / "model.safetensors").read_bytes())
    data[8:16] = b"not json"
    (path / "model.safetensors").write_bytes(bytes(data))


def edit_config(change: Callable[[dict], object]) -> Callable[[Path], None]:
    def damage(path: Path) -> None:
        config = json.loads((path / "config.json").read_text())
        (path / "config.json").write_text(json.dumps(change(config)))

    return damage


def drop_vocab_size(config: dict) -> dict:
    del config["vocab_size"]
    return config


CASES = {
    "truncated safetensors": ("model.safetensors", truncate("model.safetensors", 0.6),
                              "truncated"),
    "safetensors cut inside its header": ("model.safetensors",
                                          truncate("model.safetensors", 0.0005), "truncated"),
    "bad safetensors header": ("model.safetensors", bad_safetensors_header, "header"),
    "truncated config.json": ("config.json", truncate("config.json", 0.5), "not valid JSON"),
    "config.json without vocab_size": ("config.json", edit_config(drop_vocab_size),
                                       "'vocab_size'"),
    "config.json holding a list": ("config.json", edit_config(lambda c: [c]), "list"),
    "generation_config.json holding a list": (
        "generation_config.json",
        lambda p: (p / "generation_config.json").write_text("[1, 2]"),
        "list",
    ),
    "corrupt tokenizer.json": ("tokenizer.json", truncate("tokenizer.json", 0.5),
                               "not a valid tokenizers file"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_each_corrupt_file_is_a_checkpoint_error_naming_it(tiny, tmp_path, case) -> None:
    name, damage, fault = CASES[case]
    ckpt = broken_copy(tiny, tmp_path / "c", damage)
    with pytest.raises(CheckpointError) as info:
        load_model(ckpt, dtype="auto", device="cpu", make_layer=lambda i, t: object())
    assert info.value.path == ckpt / name
    assert str(ckpt / name) in str(info.value) and fault in str(info.value)


@pytest.mark.parametrize("case", ["truncated safetensors", "config.json without vocab_size"])
def test_the_llm_reports_the_same_error(tiny, tmp_path, case) -> None:
    name, damage, fault = CASES[case]
    ckpt = broken_copy(tiny, tmp_path / "c", damage)
    with pytest.raises(CheckpointError, match=fault) as info:
        LLM(str(ckpt), **ENGINE)
    assert isinstance(info.value, KvrunnerError) and isinstance(info.value, ValueError)


def test_a_missing_shard_named_by_the_index_is_named(tiny, tmp_path) -> None:
    ckpt = broken_copy(tiny, tmp_path / "c", lambda p: None)
    index = {"weight_map": {"model.embed_tokens.weight": "model-00002-of-00002.safetensors"}}
    (ckpt / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match="model-00002-of-00002.safetensors") as info:
        load_model(ckpt, dtype="auto", device="cpu", make_layer=lambda i, t: object())
    assert info.value.path.name == "model.safetensors.index.json"


def test_no_weights_at_all_names_the_directory(tiny, tmp_path) -> None:
    ckpt = broken_copy(tiny, tmp_path / "c", lambda p: (p / "model.safetensors").unlink())
    with pytest.raises(CheckpointError, match="no \\*.safetensors") as info:
        load_model(ckpt, dtype="auto", device="cpu", make_layer=lambda i, t: object())
    assert info.value.path == ckpt


def test_an_unsupported_architecture_names_config_json(tiny, tmp_path) -> None:
    ckpt = broken_copy(tiny, tmp_path / "c", edit_config(
        lambda c: {**c, "architectures": ["LlamaForCausalLM"]}))
    with pytest.raises(CheckpointError, match="unsupported architecture LlamaForCausalLM"):
        load_hf_config(ckpt)


#: a config.json field edit -> what the one-line error says (the field named, not a
#: symptom further on: a TypeError in arithmetic, a torch error, a projection's shape)
BAD_FIELDS = {
    "vocab_size as text": ({"vocab_size": "448"}, "vocab_size must be an integer, got '448'"),
    "negative hidden_size": ({"hidden_size": -64}, "hidden_size must be >= 1"),
    "no attention heads": ({"num_attention_heads": 0}, "num_attention_heads must be >= 1"),
    "boolean layer count": ({"num_hidden_layers": True}, "num_hidden_layers must be an integer"),
    "zero rms_norm_eps": ({"rms_norm_eps": 0.0}, "rms_norm_eps must be > 0"),
    "text tie_word_embeddings": ({"tie_word_embeddings": "no"},
                                 "tie_word_embeddings must be true or false"),
}


@pytest.mark.parametrize("case", sorted(BAD_FIELDS))
def test_a_config_field_of_the_wrong_type_or_range_is_a_config_error_naming_it_and_the_file(
    tiny, tmp_path, case
) -> None:
    fields, message = BAD_FIELDS[case]
    ckpt = broken_copy(tiny, tmp_path / "c", edit_config(lambda c: {**c, **fields}))
    with pytest.raises(ConfigError) as info:
        LLM(str(ckpt), **ENGINE)
    assert str(info.value).startswith(f"{ckpt / 'config.json'}: {message}")
    assert "\n" not in str(info.value)


def test_the_cli_prints_a_bad_config_field_as_one_line(tiny, tmp_path, capsys) -> None:
    from kvrunner.cli.main import main

    ckpt = broken_copy(tiny, tmp_path / "c", edit_config(lambda c: {**c, "hidden_size": -64}))
    assert main(["generate", "hi", "--model", str(ckpt), "--max-tokens", "2"]) == 2
    err = capsys.readouterr().err
    assert err == f"kvrunner: error: {ckpt / 'config.json'}: hidden_size must be >= 1 and " \
                  f"<= 16777216, got -64\n"
