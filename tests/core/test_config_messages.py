"""Configuration: a file is honoured as written, and every mistake is one ConfigError
that names the field (and the section it belongs in), before any weight is loaded."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import attrs
import pytest

from kvrunner import LLM, ConfigError
from kvrunner.config import EngineConfig
from kvrunner.models.tiny import write_tiny_checkpoint
from kvrunner.plugin_api import KvrunnerError

REPO = Path(__file__).resolve().parents[2]
ENGINE = dict(max_num_seqs=2, max_model_len=64, num_blocks=16, enforce_eager=True)


@pytest.fixture(scope="module")
def other_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_checkpoint(tmp_path_factory.mktemp("m") / "qwen3", seed=5)


def toml(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "engine.toml"
    path.write_text(text)
    return path


def test_the_files_model_and_dtype_are_honoured_by_llm(tmp_path, other_model) -> None:
    path = toml(tmp_path, f'model = "{other_model}"\ndtype = "bfloat16"\n'
                          "[cache]\nnum_blocks = 16\n[scheduler]\nmax_model_len = 64\n"
                          "max_num_seqs = 2\n[capture]\nenforce_eager = true\n")
    with LLM(config_file=path) as llm:
        assert (llm.config.model, llm.config.dtype) == (str(other_model), "bfloat16")
        assert llm.runner.dtype.__repr__() == "torch.bfloat16"
        assert llm.executor.model_info.path == other_model
    # An explicit keyword still wins over the file.
    with LLM(config_file=path, dtype="float32") as llm:
        assert llm.config.dtype == "float32" and llm.config.model == str(other_model)


def test_the_example_toml_loads_and_serves(tmp_path) -> None:
    example = REPO / "docs" / "example.toml"
    config = EngineConfig.load(example)
    assert config == EngineConfig.load()  # it documents the defaults
    with LLM(config_file=example, **ENGINE) as llm:
        assert llm.generate("the engine")[0].token_ids


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("block_size = 32\n", "block_size belongs in the [cache] section, not at the top level"),
        ("[cahce]\nblock_size = 32\n",
         "unknown section [cahce] (did you mean 'cache'?); valid sections: [cache], "
         "[scheduler], [parallel], [capture], [backends], [kernels]"),
        ('[cache]\nblock_size = "big"\n', "[cache] block_size must be an integer, got 'big'"),
        ("[cache]\nblock_size = true\n", "[cache] block_size must be an integer, got True"),
        ("[scheduler]\nblock_size = 8\n", "block_size belongs in the [cache] section, not "
                                          "[scheduler]"),
        ('[cache]\nmodel = "x"\n', "model is a top-level key"),
        ("[capture]\ncapture_sizes = [1, \"x\"]\n", "capture_sizes must be a list of integers"),
        ('modle = "x"\n', "unknown top-level key 'modle' (did you mean 'model'?)"),
        ("seed = 1.5\n", "seed must be an integer, got 1.5"),
        ("[cache\n", "is not valid TOML"),
        ('device = "tpu"\n', "device must be one of auto, cpu, cuda or cuda:<index>; got 'tpu'"),
    ],
)
def test_toml_mistakes_are_named_with_where_they_belong(tmp_path, text, message) -> None:
    with pytest.raises(ConfigError) as info:
        EngineConfig.load(toml(tmp_path, text))
    assert message in str(info.value)


def test_a_missing_config_file_is_named(tmp_path) -> None:
    with pytest.raises(ConfigError, match="config file 'nope.toml' does not exist"):
        EngineConfig.load("nope.toml")


@pytest.mark.parametrize("value", [float("nan"), float("inf"), "0.5", None])
def test_range_checked_fields_refuse_non_numbers(value) -> None:
    with pytest.raises(ConfigError, match="gpu_memory_utilization"):
        attrs.evolve(EngineConfig.load().cache, gpu_memory_utilization=value)


def with_max_positions(src: Path, dst: Path, limit: int, *, truncate_weights: bool) -> Path:
    shutil.copytree(src, dst)
    config = json.loads((dst / "config.json").read_text())
    (dst / "config.json").write_text(json.dumps({**config, "max_position_embeddings": limit}))
    if truncate_weights:  # loading the weights would fail: the check must come first
        weights = dst / "model.safetensors"
        weights.write_bytes(weights.read_bytes()[:1000])
    return dst


@pytest.mark.parametrize("tp", [1, 2])
def test_max_model_len_beyond_the_model_is_refused_before_loading(other_model, tmp_path,
                                                                  tp) -> None:
    ckpt = with_max_positions(other_model, tmp_path / "c", 48, truncate_weights=True)
    with pytest.raises(ConfigError) as info:
        LLM(str(ckpt), tensor_parallel_size=tp, **ENGINE)
    assert "max_model_len=64" in str(info.value)
    assert "max_position_embeddings=48" in str(info.value)


def test_max_model_len_at_the_models_limit_is_served(other_model, tmp_path) -> None:
    ckpt = with_max_positions(other_model, tmp_path / "c", 64, truncate_weights=False)
    with LLM(str(ckpt), **ENGINE) as llm:
        out = llm.generate([list(range(1, 60))], _greedy(10))[0]
    assert len(out.prompt_token_ids) + len(out.token_ids) == 64
    assert out.finish_reason == "length"


def _greedy(n: int):
    from kvrunner import SamplingParams

    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)


@pytest.mark.parametrize(
    ("heads", "kv", "tp", "message"),
    [
        (4, 2, 3, "KV heads: 2 is not divisible by tensor_parallel_size=3, nor is 3 a "
                  "multiple of 2"),
        (5, 2, 1, "num_attention_heads: 5 is not divisible by num_key_value_heads=2"),
        (6, 6, 4, "6 is not divisible by tensor_parallel_size=4"),
    ],
)
def test_head_split_messages_name_the_right_numbers(tmp_path, other_model, heads, kv, tp,
                                                    message) -> None:
    shutil.copytree(other_model, tmp_path / "c")
    config = json.loads((tmp_path / "c" / "config.json").read_text())
    config.update(num_attention_heads=heads, num_key_value_heads=kv)
    (tmp_path / "c" / "config.json").write_text(json.dumps(config))
    with pytest.raises(KvrunnerError) as info:
        LLM(str(tmp_path / "c"), tensor_parallel_size=tp, **ENGINE)
    assert message in str(info.value)
    assert "tensor parallel size 2" not in str(info.value)
