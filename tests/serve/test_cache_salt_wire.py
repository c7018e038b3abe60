"""Prefix-cache salts and weight versions over the wire, against a live ``kvrunner
serve``: vLLM's ``cache_salt`` through the official ``openai`` client (``extra_body``)
and ``/inference/v1/generate``, SGLang's ``extra_key`` on ``/generate`` through httpx.
Requests share cached prompt blocks (``usage.prompt_tokens_details.cached_tokens``,
SGLang's ``meta_info.cached_tokens``) only with requests of the same salt, and every
answer and stream chunk names the weight version its tokens were made under."""

from __future__ import annotations

import itertools

import openai
import pytest
from serve_kit import API_KEY, stream_events

MODEL = "tiny-qwen3"
BLOCK = 16  # the servers' block size (the default)
_fresh = itertools.count()


def fresh_prompt(length: int = 40) -> list[int]:
    """Token ids no other test sends: nothing of them is cached yet."""
    k = next(_fresh)
    return [50 + (7 * k + 13 * i) % 397 for i in range(length)]


def cached_whole_blocks(prompt: list[int]) -> int:
    """The prompt tokens a repeat of ``prompt`` takes from the cache: every full block
    but the one holding its last token, which is computed for its logits."""
    return (len(prompt) - 1) // BLOCK * BLOCK


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0, timeout=120)


@pytest.fixture
def version(server) -> object:
    with server.client() as http:
        return http.get("/get_weight_version").json()["weight_version"]


def _complete(client: openai.OpenAI, prompt: list[int], salt: str | None):
    extra = {"ignore_eos": True} | ({} if salt is None else {"cache_salt": salt})
    return client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=2, temperature=0.0, extra_body=extra
    )


def test_completions_share_cached_blocks_only_within_a_cache_salt(client, version) -> None:
    prompt = fresh_prompt()
    first = _complete(client, prompt, "tenant-a")
    same = _complete(client, prompt, "tenant-a")
    other = _complete(client, prompt, "tenant-b")
    unsalted = _complete(client, prompt, None)
    cached = [r.usage.prompt_tokens_details.cached_tokens for r in (first, same, other, unsalted)]
    assert cached == [0, cached_whole_blocks(prompt), 0, 0]
    assert same.choices[0].text == first.choices[0].text == other.choices[0].text
    assert first.weight_version == version  # a field beside OpenAI's
    assert first.choices[0].weight_version == version
    assert not hasattr(first.choices[0], "weight_versions")  # no update crossed


def test_chat_completions_take_a_cache_salt(client, version) -> None:
    messages = [
        {
            "role": "user",
            "content": "tell me everything about the prefix cache "
            "and how salts keep tenants apart, in great detail please " * 2,
        }
    ]

    def chat(salt: str):
        return client.chat.completions.create(
            model=MODEL,
            messages=messages,
            max_tokens=2,
            temperature=0.0,
            extra_body={"cache_salt": salt},
        )

    first, same, other = chat("chat-a"), chat("chat-a"), chat("chat-b")
    hits = [r.usage.prompt_tokens_details.cached_tokens for r in (first, same, other)]
    assert hits[0] == hits[2] == 0 < hits[1]
    assert hits[1] == cached_whole_blocks([0] * first.usage.prompt_tokens)
    assert first.weight_version == first.choices[0].weight_version == version


def test_every_stream_chunk_names_its_weight_version(client, version) -> None:
    prompt = fresh_prompt()
    _complete(client, prompt, "streamed")
    chunks = list(
        client.completions.create(
            model=MODEL,
            prompt=prompt,
            max_tokens=4,
            temperature=0.0,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"cache_salt": "streamed", "ignore_eos": True},
        )
    )
    *token_chunks, usage = chunks
    assert token_chunks and all(c.weight_version == version for c in token_chunks)
    assert token_chunks[-1].choices[0].weight_version == version  # the choice's last chunk
    assert usage.usage.prompt_tokens_details.cached_tokens == cached_whole_blocks(prompt)


def test_tokens_in_tokens_out_generate_takes_a_cache_salt(server, version) -> None:
    prompt = fresh_prompt()
    with server.client() as http:

        def generate(salt: str) -> dict:
            response = http.post(
                "/inference/v1/generate",
                json={
                    "token_ids": prompt,
                    "cache_salt": salt,
                    "sampling_params": {"max_tokens": 2, "temperature": 0.0},
                },
            )
            assert response.status_code == 200, response.text
            return response.json()

        answers = [generate("t-a"), generate("t-a"), generate("t-b")]
    assert [a["usage"]["prompt_tokens_details"]["cached_tokens"] for a in answers] == [
        0,
        cached_whole_blocks(prompt),
        0,
    ]
    assert answers[0]["weight_version"] == answers[0]["choices"][0]["weight_version"] == version


def test_sglang_generate_shares_cached_blocks_only_within_an_extra_key(server, version) -> None:
    prompt = fresh_prompt()
    with server.client() as http:

        def meta(body: dict) -> dict | list:
            response = http.post(
                "/generate",
                json={"sampling_params": {"max_new_tokens": 2, "temperature": 0.0}} | body,
            )
            assert response.status_code == 200, response.text
            answer = response.json()
            return (
                [a["meta_info"] for a in answer]
                if isinstance(answer, list)
                else answer["meta_info"]
            )

        first = meta({"input_ids": prompt, "extra_key": "k1"})
        same = meta({"input_ids": prompt, "extra_key": "k1"})
        other = meta({"input_ids": prompt, "extra_key": "k2"})
        batch = meta({"input_ids": [prompt, prompt], "extra_key": ["k1", "k3"]})
    hit = cached_whole_blocks(prompt)
    assert [m["cached_tokens"] for m in (first, same, other)] == [0, hit, 0]
    assert [m["cached_tokens"] for m in batch] == [hit, 0]
    assert first["weight_version"] == version


async def _streamed_meta(server, body: dict) -> list[dict]:
    async with server.async_client() as http:
        events = await stream_events(http, "/generate", body)
    return [e["meta_info"] for e in events]


def test_sglang_stream_events_name_their_weight_version(server, version) -> None:
    import asyncio

    prompt = fresh_prompt()
    metas = asyncio.run(
        _streamed_meta(
            server,
            {
                "input_ids": prompt,
                "extra_key": "streamed",
                "sampling_params": {"max_new_tokens": 4, "temperature": 0.0, "ignore_eos": True},
            },
        )
    )
    assert metas and all(m["weight_version"] == version for m in metas)


@pytest.mark.parametrize(
    ("path", "body", "field"),
    [
        ("/v1/completions", {"model": MODEL, "prompt": [1, 2, 3], "cache_salt": ""}, "cache_salt"),
        ("/v1/completions", {"model": MODEL, "prompt": [1, 2, 3], "cache_salt": 7}, "cache_salt"),
        ("/inference/v1/generate", {"token_ids": [1, 2, 3], "cache_salt": ""}, "cache_salt"),
        ("/generate", {"input_ids": [1, 2, 3], "extra_key": ""}, "extra_key"),
        ("/generate", {"input_ids": [[1, 2], [3]], "extra_key": ["a"]}, "extra_key"),
    ],
)
def test_a_bad_salt_is_a_400_naming_its_field(server, path, body, field) -> None:
    with server.client() as http:
        response = http.post(path, json=body)
    assert response.status_code == 400, response.text
    assert field in response.text
