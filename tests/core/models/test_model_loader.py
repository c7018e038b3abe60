"""The HF-format loader: config parsing, architecture registry, weight-name checks."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from kvrunner.models.loader import load_model, model_spec, read_config, resolve_dtype
from kvrunner.models.qwen3 import Qwen3Config, Qwen3ForCausalLM
from kvrunner.models.tiny import write_tiny_checkpoint
from kvrunner.plugin_api import ModelSpec

BASE = dict(
    hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, vocab_size=100,
)


def no_layer(layer_index: int, layer_type: str) -> object:
    return object()  # loading never calls attention


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_checkpoint(tmp_path_factory.mktemp("tiny") / "ckpt")


def copy_with_weights(src: Path, dst: Path, edit) -> Path:
    dst.mkdir()
    for f in src.iterdir():
        if f.suffix != ".safetensors":
            (dst / f.name).write_bytes(f.read_bytes())
    tensors = load_file(str(src / "model.safetensors"))
    edit(tensors)
    save_file(tensors, str(dst / "model.safetensors"))
    return dst


def test_config_defaults_follow_hf() -> None:
    c = Qwen3Config.from_hf_dict({**BASE, "num_key_value_heads": None})
    assert c.head_dim == 16 and c.num_key_value_heads == 4
    assert c.layer_types == ("full_attention", "full_attention")
    assert c.rope_theta == 10000.0 and not c.tie_word_embeddings and c.eos_token_id == ()


@pytest.mark.parametrize(
    "rope",
    [
        {"rope_theta": 5e5},
        {"rope_parameters": {"rope_type": "default", "rope_theta": 5e5}},
        {"rope_scaling": {"rope_theta": 5e5}},
    ],
    ids=["flat", "rope_parameters", "rope_scaling"],
)
def test_rope_theta_in_every_config_form(rope: dict) -> None:
    assert Qwen3Config.from_hf_dict({**BASE, **rope}).rope_theta == 5e5


def test_scaled_rope_and_sliding_window_are_refused() -> None:
    with pytest.raises(ValueError, match="yarn"):
        Qwen3Config.from_hf_dict({**BASE, "rope_scaling": {"rope_type": "yarn", "factor": 4.0}})
    with pytest.raises(ValueError, match="sliding"):
        Qwen3Config.from_hf_dict({**BASE, "use_sliding_window": True})


def test_eos_from_config_and_generation_config_are_merged(tiny: Path, tmp_path: Path) -> None:
    ckpt = copy_with_weights(tiny, tmp_path / "c", lambda t: None)
    (ckpt / "generation_config.json").write_text(json.dumps({"eos_token_id": [7, 0]}))
    _, config = read_config(ckpt)
    assert config.eos_token_id == (0, 7)  # config's first, then new ones, no duplicates


def test_model_spec_divides_heads_by_tp() -> None:
    c = Qwen3Config.from_hf_dict(BASE)
    assert model_spec(c) == ModelSpec(
        num_layers=2, layer_types=("full_attention",) * 2, num_heads=4, num_kv_heads=2, head_dim=16
    )
    assert (model_spec(c, 2).num_heads, model_spec(c, 2).num_kv_heads) == (2, 1)
    assert (model_spec(c, 4).num_heads, model_spec(c, 4).num_kv_heads) == (1, 1)  # KV replicated
    with pytest.raises(ValueError, match="divisible"):
        model_spec(c, 3)
    raw = {**BASE, "architectures": ["Qwen3ForCausalLM"]}
    assert model_spec(raw, 2) == model_spec(c, 2)  # a raw config.json dict works too


def test_unknown_architecture_lists_supported(tiny: Path, tmp_path: Path) -> None:
    ckpt = copy_with_weights(tiny, tmp_path / "c", lambda t: None)
    raw = json.loads((ckpt / "config.json").read_text())
    (ckpt / "config.json").write_text(json.dumps({**raw, "architectures": ["LlamaForCausalLM"]}))
    with pytest.raises(ValueError, match="LlamaForCausalLM.*supported: .*Qwen3ForCausalLM"):
        read_config(ckpt)
    del raw["architectures"]  # model_type alone is enough
    (ckpt / "config.json").write_text(json.dumps(raw))
    assert read_config(ckpt)[0] is Qwen3ForCausalLM


def test_missing_and_unexpected_weights_are_named(tiny: Path, tmp_path: Path) -> None:
    def edit(t: dict) -> None:
        del t["model.layers.1.self_attn.k_proj.weight"]
        del t["model.norm.weight"]
        t["model.layers.0.mlp.extra.weight"] = torch.zeros(2)

    ckpt = copy_with_weights(tiny, tmp_path / "c", edit)
    with pytest.raises(ValueError) as err:
        load_model(ckpt, dtype="auto", device="cpu", make_layer=no_layer)
    message = str(err.value)
    assert "missing 2: model.layers.1.self_attn.k_proj.weight, model.norm.weight" in message
    assert "unexpected 1: model.layers.0.mlp.extra.weight" in message


def test_wrong_shape_names_the_tensor(tiny: Path, tmp_path: Path) -> None:
    def edit(t: dict) -> None:
        t["model.layers.0.mlp.up_proj.weight"] = torch.zeros(127, 64)

    ckpt = copy_with_weights(tiny, tmp_path / "c", edit)
    with pytest.raises(ValueError, match=r"model\.layers\.0\.mlp\.up_proj\.weight.*127"):
        load_model(ckpt, dtype="auto", device="cpu", make_layer=no_layer)


def test_every_layer_gets_its_own_impl_with_its_type(tiny: Path) -> None:
    calls: list[tuple[int, str]] = []

    def make_layer(i: int, kind: str) -> tuple[int, str]:
        calls.append((i, kind))
        return (i, kind)

    model, _, _ = load_model(tiny, dtype="auto", device="cpu", make_layer=make_layer,
                             progress=True)
    assert calls == [(0, "full_attention"), (1, "full_attention")]
    assert [layer.self_attn.impl for layer in model.model.layers] == calls
    assert not any("impl" in name for name, _ in model.named_parameters())


def test_dtype_names_and_auto(tiny: Path) -> None:
    _, config = read_config(tiny)
    assert resolve_dtype("auto", config) == torch.float32
    assert resolve_dtype("bfloat16", config) == torch.bfloat16
    assert resolve_dtype(torch.float16, config) == torch.float16
    with pytest.raises(ValueError, match="unknown dtype"):
        resolve_dtype("float8", config)


def test_a_checkpoint_without_tokenizer_loads_with_no_tokenizer(tiny: Path, tmp_path: Path) -> None:
    ckpt = copy_with_weights(tiny, tmp_path / "c", lambda t: None)
    (ckpt / "tokenizer.json").unlink()
    model, tokenizer, _ = load_model(ckpt, dtype="auto", device="cpu", make_layer=no_layer)
    assert tokenizer is None and model.lm_head.weight.shape[0] == 448  # weights did load


def test_skip_tokenizer_loads_none_even_when_the_checkpoint_has_one(tiny: Path) -> None:
    _, tokenizer, _ = load_model(tiny, dtype="auto", device="cpu", make_layer=no_layer,
                                 skip_tokenizer=True)
    assert tokenizer is None
