"""Sampling defaults come from the checkpoint's ``generation_config.json``.

As vLLM's ``generation_config="auto"``: a request made without SamplingParams
samples with the keys the checkpoint sets (temperature, top_p, top_k,
max_new_tokens); ``generation_config="ignore"`` keeps SamplingParams' own defaults;
a SamplingParams passed in is used as given. A value the checkpoint sets that
SamplingParams would refuse is a CheckpointError naming the file, at start.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvrunner import LLM, SamplingParams
from kvrunner.errors import CheckpointError
from kvrunner.models.generation_config import sampling_defaults
from kvrunner.models.tiny import write_tiny_checkpoint

PROMPTS = [[5, 6, 7], [9, 10, 11, 12]]


def with_generation_config(root: Path, name: str, **keys: object) -> Path:
    path = write_tiny_checkpoint(root / name)
    file = path / "generation_config.json"
    file.write_text(json.dumps({**json.loads(file.read_text()), **keys}))
    return path


@pytest.fixture(scope="module")
def greedy_ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return with_generation_config(tmp_path_factory.mktemp("gen"), "greedy",
                                  temperature=0.0, top_k=20, max_new_tokens=3)


def test_a_request_without_params_samples_with_the_checkpoints_defaults(greedy_ckpt) -> None:
    with LLM(str(greedy_ckpt), enforce_eager=True, max_num_seqs=2) as llm:
        assert llm.default_sampling_params == SamplingParams(
            temperature=0.0, top_k=20, max_tokens=3
        )
        got = llm.generate(PROMPTS)
        want = llm.generate(PROMPTS, SamplingParams(temperature=0.0, top_k=20, max_tokens=3))
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert all(len(o.token_ids) == 3 and o.finish_reason == "length" for o in got)


def test_ignore_keeps_sampling_params_own_defaults(greedy_ckpt) -> None:
    with LLM(str(greedy_ckpt), enforce_eager=True, max_num_seqs=2,
             generation_config="ignore") as llm:  # fmt: skip
        assert llm.default_sampling_params == SamplingParams()
        out = llm.generate(PROMPTS)
    # max_tokens 16, not the checkpoint's 3 (or a stop before it)
    assert all(len(o.token_ids) == 16 or o.finish_reason == "stop" for o in out)
    assert any(len(o.token_ids) > 3 for o in out)


def test_params_passed_in_are_used_as_given(greedy_ckpt) -> None:
    with LLM(str(greedy_ckpt), enforce_eager=True, max_num_seqs=2) as llm:
        out = llm.generate(PROMPTS, SamplingParams(max_tokens=5, temperature=0.0))
    assert all(len(o.token_ids) == 5 or o.finish_reason == "stop" for o in out)


def test_a_checkpoint_without_sampling_keys_leaves_the_defaults(tmp_path) -> None:
    assert sampling_defaults(write_tiny_checkpoint(tmp_path / "plain")) == {}


@pytest.mark.parametrize(("key", "value"), [("temperature", "hot"), ("top_p", 0.0),
                                            ("max_new_tokens", 0), ("top_k", 1.5)])
def test_an_unusable_default_names_the_file_and_the_key(tmp_path, key, value) -> None:
    path = with_generation_config(tmp_path, "bad", **{key: value})
    with pytest.raises(CheckpointError, match=rf"generation_config.json.*{key}="):
        LLM(str(path), enforce_eager=True)
