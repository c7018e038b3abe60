"""TRL's own ``VLLMClient`` (trl 1.16.0, ``trl/generation/vllm_client.py``: GRPO's server
mode) against a live ``kvrunner serve``, unchanged: its ``generate``, ``chat``,
``get_sequence_logprobs``, ``get_world_size`` and ``reset_prefix_cache``, each answer
equal to the in-process ``LLM.generate``.

The client refuses to start unless the ``vllm`` package is importable (its weight
sync builds on vLLM's NCCL engine). vLLM is not installed here, so that one check is
answered yes for the client's module; every byte on the wire is the client's own.
Its weight transfer (``init_communicator``) needs CUDA and vLLM's NCCL engine, so it
is not run here.
"""

from __future__ import annotations

import pytest

from kvrunner import SamplingParams

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
