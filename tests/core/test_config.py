"""Config: frozen, validated, loaded from TOML then overridden by flat keywords."""

from __future__ import annotations

import attrs
import pytest

from kvrunner.config import ConfigError, EngineConfig


def test_defaults_select_paged_for_full_attention_and_gdn_for_linear() -> None:
    cfg = EngineConfig.load()
    assert cfg.backends.for_layer_type("full_attention") == "paged"
    assert cfg.backends.for_layer_type("linear_attention") == "gdn"


def test_toml_sections_load_and_flat_overrides_win(tmp_path) -> None:
    path = tmp_path / "engine.toml"
    path.write_text(
        'model = "m"\n[cache]\nblock_size = 32\nnum_blocks = 7\n'
        '[scheduler]\nmax_num_seqs = 4\n[backends]\nfull_attention = "flatkv"\n'
    )
    cfg = EngineConfig.load(path, block_size=8)
    assert (cfg.model, cfg.cache.block_size, cfg.cache.num_blocks) == ("m", 8, 7)
    assert cfg.scheduler.max_num_seqs == 4
    assert cfg.backends.full_attention == "flatkv"


def test_config_is_frozen() -> None:
    cfg = EngineConfig.load()
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        cfg.cache.block_size = 8  # type: ignore[misc]


@pytest.mark.parametrize(
    ("overrides", "named"),
    [
        ({"block_size": 0}, "block_size"),
        ({"block_size": 257}, "block_size"),
        ({"gpu_memory_utilization": 1.5}, "gpu_memory_utilization"),
        ({"max_num_seqs": 0}, "max_num_seqs"),
        ({"no_such_key": 1}, "no_such_key"),
        ({"dtype": "int8"}, "dtype must be one of auto, float32, bfloat16, float16; got 'int8'"),
        ({"all_reduce": "mpi"}, "all_reduce must be one of auto, nccl, symm_mem; got 'mpi'"),
        ({"distributed_backend": "mpi"}, "distributed_backend must be one of auto, gloo, nccl"),
    ],
)
def test_bad_values_raise_an_error_naming_the_field(overrides, named) -> None:
    with pytest.raises(ConfigError, match=named):
        EngineConfig.load(**overrides)


def test_unknown_key_in_a_toml_section_is_named(tmp_path) -> None:
    path = tmp_path / "bad.toml"
    path.write_text("[cache]\nblok_size = 4\n")
    with pytest.raises(ConfigError, match="blok_size"):
        EngineConfig.load(path)


def test_unknown_layer_type_lists_the_known_ones() -> None:
    with pytest.raises(ConfigError, match="full_attention"):
        EngineConfig.load().backends.for_layer_type("sliding_window")
