"""AReaL's own ``RemoteSGLangEngine`` (areal 1.0.4, ``areal/engine/sglang_remote.py``
over ``areal/infra/remote_inf_engine.py``) against a live ``kvrunner serve``,
unchanged: its ``agenerate`` (SGLang's ``/generate`` with ``input_ids``,
``image_data: []`` and ``return_logprob``), its pause and resume, and its disk weight
update, each checked against the in-process ``LLM``.
"""

from __future__ import annotations

import asyncio
from datetime import datetime
from pathlib import Path

import pytest

from kvrunner import LLM, SamplingParams
from kvrunner.models.tiny import write_tiny_checkpoint

remote = pytest.importorskip("areal.engine.sglang_remote")
cli_args = pytest.importorskip("areal.api.cli_args")
io_struct = pytest.importorskip("areal.api.io_struct")
areal_api = pytest.importorskip("areal.api")
name_resolve = pytest.importorskip("areal.utils.name_resolve")
names = pytest.importorskip("areal.utils.names")

EXPERIMENT, TRIAL = "kvrunner-compat", "trial0"


@pytest.fixture(scope="module")
def sglang_like_server(tmp_path_factory, compat_home):
    """A server of this module's own: its disk update changes the weights it serves."""
    from serve_kit import start_server

    from kvrunner.models.tiny import ensure_default_model

    ensure_default_model("tiny-qwen3")
    server = start_server(tmp_path_factory.mktemp("areal_logs"), compat_home, "areal",
                          ["--enable-rl-endpoints"], api_key=None).wait_ready()
    yield server
    assert server.stop() == 0


@pytest.fixture(scope="module")
def engine(sglang_like_server, tmp_path_factory):
    # AReaL's trainer and rollout meet through its name service (files, by default)
    name_resolve.reconfigure(cli_args.NameResolveConfig(
        type="nfs", nfs_record_root=str(tmp_path_factory.mktemp("name_resolve"))))
    config = cli_args.InferenceEngineConfig(
        backend="sglang:d1", request_timeout=120, setup_timeout=120,
        experiment_name=EXPERIMENT, trial_name=TRIAL)
    engine = remote.RemoteSGLangEngine(config)
    engine.initialize(addr=sglang_like_server.url.removeprefix("http://"))
    yield engine
    engine.destroy()


def generate(engine, prompt: list[int], **gconfig) -> object:
    request = io_struct.ModelRequest(
        input_ids=prompt, gconfig=cli_args.GenerationHyperparameters(**gconfig))
    return asyncio.run(engine.agenerate(request))


def test_agenerate_returns_the_engines_greedy_tokens_and_logprobs(engine, reference_llm):
    prompt = [5, 17, 42, 9]
    got = generate(engine, prompt, max_new_tokens=6, greedy=True, ignore_eos=True)
    (ref,) = reference_llm.generate([prompt], SamplingParams(
        temperature=0.0, max_tokens=6, logprobs=0, ignore_eos=True))
    assert got.input_tokens == prompt
    assert got.output_tokens == ref.token_ids
    assert got.output_logprobs == pytest.approx(ref.logprobs, abs=1e-5)
    assert got.stop_reason == "length"


def test_generation_paused_and_continued_on_the_server_serves_the_same_tokens(
        engine, reference_llm):
    engine.pause_generation()
    engine.continue_generation()
    got = generate(engine, [8, 9, 10], max_new_tokens=3, greedy=True, ignore_eos=True)
    (ref,) = reference_llm.generate([[8, 9, 10]], SamplingParams(
        temperature=0.0, max_tokens=3, ignore_eos=True))
    assert got.output_tokens == ref.token_ids


def test_a_disk_update_serves_the_new_checkpoint(engine, tmp_path: Path):
    path = write_tiny_checkpoint(tmp_path / "next", kind="qwen3", seed=5)
    with LLM(model=str(path), max_num_seqs=2) as fresh:
        (ref,) = fresh.generate([[3, 4, 5]], SamplingParams(temperature=0.0, max_tokens=5,
                                                            ignore_eos=True))
    before = generate(engine, [3, 4, 5], max_new_tokens=5, greedy=True, ignore_eos=True)
    assert before.output_tokens != ref.token_ids, "the two checkpoints must answer differently"
    meta = areal_api.WeightUpdateMeta(type="disk", path=str(path))
    # what AReaL's FSDP engine does around its save (fsdp_engine._update_weights_from_disk)
    engine.pause_generation()
    done = engine.update_weights_from_disk(meta)
    name_resolve.add(names.update_weights_from_disk(EXPERIMENT, TRIAL, engine.get_version()),
                     str(datetime.now().timestamp()), keepalive_ttl=120)
    done.result(timeout=120)
    engine.continue_generation()
    got = generate(engine, [3, 4, 5], max_new_tokens=5, greedy=True, ignore_eos=True)
    assert got.output_tokens == ref.token_ids
    assert not path.exists(), "AReaL deletes the checkpoint once the engine loaded it"
