"""TRL's own ``VLLMClient`` (trl 1.16.0, ``trl/generation/vllm_client.py``: GRPO's server
mode) against a live ``kvrunner serve``, unchanged: its ``generate``, ``chat``,
``get_sequence_logprobs``, ``get_world_size`` and ``reset_prefix_cache``, each answer
equal to the in-process ``LLM.generate``; its weight pushes (``weight_update`` with
``update_named_param``, ``update_model_params``, ``close_communicator``), after which
the server's greedy tokens equal a fresh engine's on the pushed checkpoint.

The client refuses to start unless the ``vllm`` package is importable (its weight
sync builds on vLLM's NCCL engine). vLLM is not installed here, so that one check is
answered yes for the client's module; every byte on the wire is the client's own.
Its ``init_communicator`` cannot run on the CPU: it refuses a device that is not
CUDA and builds its group with vLLM's ``trainer_init`` (``PyNcclCommunicator``). It
is replayed from its source (the same HTTP call and body, ``packed: true`` as TRL
sends it to vLLM >= 0.28), the trainer's end joining the engine's group over gloo;
vLLM's ``packed_nccl_broadcast_producer``, which TRL's update calls, is its replay
over that group (tests/weight_sync/peer_trainers.py, the vLLM commit cited there).
"""

from __future__ import annotations

import socket
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from kvrunner import SamplingParams

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "weight_sync"))

vllm_client = pytest.importorskip("trl.generation.vllm_client")


@pytest.fixture(scope="module")
def client(vllm_like_server):
    patch = pytest.MonkeyPatch()
    patch.setattr(vllm_client, "is_vllm_available", lambda *args, **kwargs: True)
    yield vllm_client.VLLMClient(base_url=vllm_like_server.url, connection_timeout=60)
    patch.undo()


def test_generate_returns_the_engines_tokens_and_logprobs(client, reference_llm) -> None:
    prompts = [[5, 17, 42, 9], [3, 4]]
    got = client.generate(prompts, n=2, temperature=0.8, max_tokens=5, logprobs=0,
                          generation_kwargs={"seed": 7, "ignore_eos": True})
    refs = reference_llm.generate(prompts, SamplingParams(
        n=2, temperature=0.8, max_tokens=5, logprobs=0, seed=7, ignore_eos=True))
    assert got["prompt_ids"] == prompts
    assert got["completion_ids"] == [r.token_ids for r in refs]
    assert got["logprob_token_ids"] == [[[t] for t in r.token_ids] for r in refs]
    for row, ref in zip(got["logprobs"], refs, strict=True):
        assert [lp for (lp,) in row] == pytest.approx(ref.logprobs, abs=1e-5)


def test_generate_with_top_logprobs_ranks_them_as_vllm(client, reference_llm) -> None:
    got = client.generate([[8, 9, 10]], temperature=0.0, max_tokens=3, logprobs=2)
    (ref,) = reference_llm.generate([[8, 9, 10]], SamplingParams(
        temperature=0.0, max_tokens=3, logprobs=2))
    for ids, values, token, top in zip(got["logprob_token_ids"][0], got["logprobs"][0],
                                       ref.token_ids, ref.top_logprobs, strict=True):
        assert token in ids and set(ids) == {token, *top}
        assert values == sorted(values, reverse=True)


def get_weather(town: str) -> str:
    """The weather in a town.

    Args:
        town: the town's name.
    """
    return "rain"


def test_chat_renders_tools_and_template_kwargs_and_generates(client, reference_llm) -> None:
    messages = [[{"role": "user", "content": "weather by the river?"}],
                [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]]
    got = client.chat(messages, temperature=0.0, max_tokens=4, tools=[get_weather],
                      chat_template_kwargs={"enable_thinking": False})
    for prompt, completion in zip(got["prompt_ids"], got["completion_ids"], strict=True):
        (ref,) = reference_llm.generate([prompt], SamplingParams(temperature=0.0,
                                                                 max_tokens=4))
        assert completion == ref.token_ids
    text = reference_llm.tokenizer.decode(got["prompt_ids"][0], skip_special_tokens=False)
    assert "get_weather" in text and text.endswith("<think>\n\n</think>\n\n")


def test_sequence_logprobs_are_the_engines_prompt_logprobs(client, reference_llm) -> None:
    sequences = [[4, 5, 6, 7, 8, 9], [10, 11, 12, 13]]
    got = client.get_sequence_logprobs(sequences, prompt_lengths=[3, 2], top_logprobs=3)
    for seq, start, actual, tops in zip(sequences, [3, 2], got["actual_logprobs"],
                                        got["logprob_token_ids"], strict=True):
        (ref,) = reference_llm.generate([seq], SamplingParams(max_tokens=1, temperature=1.0,
                                                              prompt_logprobs=3))
        assert [lp for (lp,) in actual] == pytest.approx(ref.prompt_logprobs[start:], abs=1e-5)
        assert tops == [list(ref.prompt_top_logprobs[p]) for p in range(start, len(seq))]


def test_world_size_and_prefix_cache_reset(client) -> None:
    assert client.get_world_size() == 1
    client.reset_prefix_cache()  # answers 200 (the client raises on anything else)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def pushing_client(vllm_like_server, compat_home):
    """A client whose communicator is joined (``init_communicator`` replayed), with
    vLLM's packed producer replayed over gloo where TRL calls it; the served weights
    are the embedded model's again afterwards."""
    from peer_trainers import Communicator, packed_nccl_broadcast_producer, trainers_group

    from kvrunner.models.tiny import ensure_default_model

    patch = pytest.MonkeyPatch()
    patch.setattr(vllm_client, "is_vllm_available", lambda *args, **kwargs: True)
    patch.setattr(vllm_client, "_HAS_STATEFUL_TRAINER_ENGINE", True)
    patch.setattr(vllm_client, "packed_nccl_broadcast_producer",
                  packed_nccl_broadcast_producer, raising=False)
    client = vllm_client.VLLMClient(base_url=vllm_like_server.url, group_port=free_port(),
                                    connection_timeout=60)
    # init_communicator, as TRL 1.16.0 writes it, but for its CUDA device and its group
    assert client.get_server_info()["weight_transfer_config"] == {"backend": "nccl"}
    world_size = client.get_world_size() + 1
    init_info = {"master_address": "127.0.0.1", "master_port": client.group_port,
                 "rank_offset": 1, "world_size": world_size, "packed": True}
    with ThreadPoolExecutor(max_workers=1) as executor:
        future = executor.submit(client._post, f"{client.base_url}/init_weight_transfer_engine",
                                 json={"init_info": init_info})
        client.communicator = Communicator(trainers_group(
            backend="gloo", address="127.0.0.1", port=client.group_port,
            world_size=world_size, group_name="kvrunner_weights"))
        future.result()
    yield client
    restored = client.session.post(f"{client.base_url}/update_weights_from_disk", json={
        "model_path": str(ensure_default_model("tiny-qwen3"))})
    assert restored.status_code == 200, restored.text
    patch.undo()


def pushed_model(tmp_path: Path, seed: int):
    """A trainer's model: the embedded model's shape with other weights, as GRPO holds
    it (transformers), and the checkpoint it was loaded from."""
    from transformers import AutoModelForCausalLM

    from kvrunner.models.tiny import write_tiny_checkpoint

    path = write_tiny_checkpoint(tmp_path / f"seed{seed}", kind="qwen3", seed=seed)
    return AutoModelForCausalLM.from_pretrained(path, torch_dtype="float32"), path


def served_and_fresh(client, path: Path) -> tuple[list[list[int]], list[list[int]]]:
    """The server's greedy tokens (through the client) and a fresh engine's on ``path``."""
    from serve_kit import ENGINE_KWARGS

    from kvrunner.llm import LLM

    prompts = [[5, 17, 42, 9], [3, 4], [8, 9, 10, 11, 12]]
    served = client.generate(prompts, temperature=0.0, max_tokens=6,
                             generation_kwargs={"ignore_eos": True})["completion_ids"]
    fresh = LLM(**{**ENGINE_KWARGS, "model": str(path)})
    try:
        outs = fresh.generate(prompts, SamplingParams(temperature=0.0, max_tokens=6,
                                                      ignore_eos=True))
    finally:
        fresh.shutdown()
    return served, [o.token_ids for o in outs]


def test_weight_update_with_update_named_param_lands_every_param(
    pushing_client, tmp_path
) -> None:
    model, path = pushed_model(tmp_path, 5)
    before = pushing_client.generate([[5, 17, 42, 9]], temperature=0.0, max_tokens=6,
                                     generation_kwargs={"ignore_eos": True})
    with pushing_client.weight_update():
        for name, param in model.named_parameters():
            pushing_client.update_named_param(name, param.data)
    served, fresh = served_and_fresh(pushing_client, path)
    assert served == fresh
    assert served[0] != before["completion_ids"][0]


def test_update_model_params_lands_the_model_and_the_communicator_closes(
    pushing_client, tmp_path
) -> None:
    model, path = pushed_model(tmp_path, 6)
    pushing_client.update_model_params(model)
    served, fresh = served_and_fresh(pushing_client, path)
    assert served == fresh
    pushing_client.close_communicator()
    assert pushing_client.communicator is None
