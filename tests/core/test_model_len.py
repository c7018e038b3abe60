"""``max_model_len`` unset is the model's ``max_position_embeddings``, capped by the pool.

vLLM derives the default from the model; a fixed default refuses a checkpoint with
fewer positions for a value the user never set, and silently cuts one with more.
The ranks resolve it once the pool is sized, the driver's scheduler and
``llm.config`` take theirs, and the start prints one line saying where it came from.
A value the user sets is kept, and one above the model's positions is refused.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvrunner import LLM, SamplingParams
from kvrunner.config import ConfigError
from kvrunner.errors import RequestError
from kvrunner.models.tiny import write_tiny_checkpoint
from kvrunner.runner.model_len import agreed_model_len, fit_model_len, min_pool_blocks

GREEDY = SamplingParams(max_tokens=2, temperature=0.0)


def checkpoint_with_positions(root: Path, positions: int) -> Path:
    path = write_tiny_checkpoint(root / f"pos{positions}")
    config = json.loads((path / "config.json").read_text())
    config["max_position_embeddings"] = positions
    (path / "config.json").write_text(json.dumps(config))
    return path


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory: pytest.TempPathFactory) -> dict[int, Path]:
    root = tmp_path_factory.mktemp("positions")
    return {n: checkpoint_with_positions(root, n) for n in (512, 32768)}


def test_a_checkpoint_with_512_positions_loads_on_defaults(ckpts, capfd) -> None:
    with LLM(str(ckpts[512]), max_num_seqs=2, enforce_eager=True) as llm:
        assert llm.config.scheduler.max_model_len == 512
        assert llm.engine.scheduler.config.max_model_len == 512
        out = llm.generate([[5] * 500], GREEDY)
        assert len(out[0].token_ids) == 2
        assert llm.executor.describe_ranks()[0]["max_model_len"] == 512
    err = capfd.readouterr().err
    assert err.count("max_model_len=512 (the model's max_position_embeddings)") == 1


def test_a_checkpoint_with_32k_positions_is_not_cut_to_2048(ckpts) -> None:
    with LLM(str(ckpts[32768]), max_num_seqs=2, enforce_eager=True) as llm:
        assert llm.config.scheduler.max_model_len == 32768
        # a prompt past 2,048 tokens is served
        out = llm.generate([[5] * 2100], SamplingParams(max_tokens=1, temperature=0.0))
        assert len(out[0].token_ids) == 1


def test_a_pool_smaller_than_the_model_caps_the_length_and_says_so(ckpts, capfd) -> None:
    with LLM(str(ckpts[32768]), max_num_seqs=2, enforce_eager=True,
             num_blocks=8, block_size=16) as llm:  # fmt: skip
        assert llm.config.scheduler.max_model_len == 128
        with pytest.raises(RequestError, match="max_model_len"):
            llm.generate([[5] * 200], GREEDY)
    err = capfd.readouterr().err
    assert "max_model_len=128 (the KV pool holds 128 tokens (8 blocks of 16)" in err
    assert "max_position_embeddings=32768" in err


def test_a_value_set_is_kept_and_not_announced(ckpts, capfd) -> None:
    with LLM(str(ckpts[512]), max_num_seqs=2, enforce_eager=True, max_model_len=100) as llm:
        assert llm.config.scheduler.max_model_len == 100
    assert "max_model_len=" not in capfd.readouterr().err


def test_a_value_set_above_the_models_positions_is_refused(ckpts) -> None:
    with pytest.raises(ConfigError, match="max_model_len=1024 exceeds .*embeddings=512"):
        LLM(str(ckpts[512]), max_num_seqs=2, enforce_eager=True, max_model_len=1024)


@given(
    asked=st.none() | st.integers(2, 4096),
    # ranges of one order, so pools both above and below the model's positions come up
    positions=st.integers(2, 4096),
    num_blocks=st.integers(1, 512),
    block_size=st.sampled_from([1, 2, 16]),
)
def test_the_resolved_length_is_the_asked_one_or_fits_model_and_pool(
    asked, positions, num_blocks, block_size
) -> None:
    if num_blocks < min_pool_blocks(asked, block_size):
        return  # sizing refuses such a pool before the length is fitted
    got = fit_model_len(asked, positions, num_blocks=num_blocks, block_size=block_size)
    if asked is not None:
        assert (got.value, got.source) == (asked, "config")
        return
    assert got.value == min(positions, num_blocks * block_size) >= 2
    assert got.source == ("model" if got.value == positions else "pool")


def test_ranks_report_one_length_or_are_refused() -> None:
    one = {"max_model_len": 64, "max_model_len_source": "pool", "max_model_len_reason": "r"}
    assert agreed_model_len([one, one]).value == 64
    with pytest.raises(ConfigError, match=r"different max_model_len \[64, 96\]"):
        agreed_model_len([one, {**one, "max_model_len": 96}])
