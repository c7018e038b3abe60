"""2,000 concurrent streaming requests on loopback (``KVRUNNER_LOAD_STREAMS`` sets
another count: 5,000 is the production-shaped run), in three waves after a warm-up
wave, against one server.

Half stream SGLang's ``/generate`` (cumulative events, the client's ``rid``), half
OpenAI's ``/v1/completions`` (text deltas). No request is lost or duplicated: each
stream carries one id, ends exactly once (one event with a finish reason, the last,
then ``data: [DONE]``), its text is the in-process ``LLM``'s for its prompt, and the
server counts exactly the tokens the clients received, with nothing left running
or holding a block after each wave.

The server's resident memory is flat across the three measured waves. A warm-up
wave of the same load comes first and is not measured: it and the first measured
wave warm the allocator, the tokenizer's caches and uvicorn's buffers (on a loaded
2-core machine that warm-up was seen to add 4.8 MiB in the wave after the first and
0.3 MiB after that). From the first measured wave on, the later two together may add
at most ``RSS_GROWTH_KIB``, 1 KiB per request of theirs (4 MiB). A
request's own state on the server (its live record, channel, output, SSE buffers)
is several KiB, so keeping it, or a fraction of it, for each finished request would
cross the bound; the bound is four times the largest wave-to-wave wobble measured
on an idle server between waves (under 1 MiB), the allocator's own noise.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from collections.abc import Iterator

import pytest
from serve_kit import API_KEY, SETTING_FLAGS, ServeProcess, scrape, sse_payloads, start_server

from kvrunner import SamplingParams

CONCURRENT = int(os.environ.get("KVRUNNER_LOAD_STREAMS", "2000"))
WAVES = 4  # the first is the warm-up, not measured
NEW_TOKENS = 3
PROMPTS = [[5 + k, 6 + k, 7 + 2 * k] for k in range(8)]
#: what the measured waves after the first may add to the server's RSS, together: 1 KiB
#: for each of their requests (see the module docstring)
RSS_GROWTH_KIB = (WAVES - 2) * CONCURRENT


@pytest.fixture(scope="module")
def load_server(tmp_path_factory, serve_home) -> Iterator[ServeProcess]:
    flags = [*SETTING_FLAGS, "--max-num-seqs", "256"]  # the later flag wins
    server = start_server(tmp_path_factory.mktemp("load_logs"), serve_home, "load", [],
                          api_key=API_KEY, engine_flags=flags).wait_ready()
    yield server
    assert server.stop() == 0


async def _stream(port: int, path: str, body: dict) -> list[dict]:
    """One streaming POST over its own loopback connection: a plain HTTP/1.1 client on
    asyncio's sockets (httpx costs about 6 ms of the test's CPU a stream, which on two
    cores would time the client, not the server); the chunked body is decoded and
    its server-sent events parsed."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    payload = json.dumps(body).encode()
    writer.write(f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                 f"Authorization: Bearer {API_KEY}\r\nContent-Type: application/json\r\n"
                 f"Content-Length: {len(payload)}\r\nConnection: close\r\n\r\n".encode()
                 + payload)
    raw = await reader.read()  # to the server's close: the whole response
    writer.close()
    head, _, rest = raw.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200"), raw[:300]
    assert b"transfer-encoding: chunked" in head.lower()
    text = bytearray()
    while True:
        size_line, _, rest = rest.partition(b"\r\n")
        size = int(size_line, 16)
        if size == 0:
            break
        text += rest[:size]
        rest = rest[size + 2:]
    return sse_payloads(text.decode().split("\n"))  # type: ignore[return-value]


def _generate_body(rid: str, prompt: list[int]) -> dict:
    return {"input_ids": prompt, "rid": rid, "stream": True,
            "sampling_params": {"max_new_tokens": NEW_TOKENS, "temperature": 0.0,
                                "ignore_eos": True}}


def _completion_body(prompt: list[int]) -> dict:
    return {"model": "tiny-qwen3", "prompt": prompt, "max_tokens": NEW_TOKENS,
            "temperature": 0.0, "ignore_eos": True, "stream": True}


def _check_generate(rid: str, events: list[dict], want_text: str, want_ids: list[int]) -> None:
    assert {e["meta_info"]["id"] for e in events} == {rid}
    reasons = [e["meta_info"]["finish_reason"] for e in events]
    assert reasons[-1] == {"type": "length", "length": NEW_TOKENS}
    assert all(r is None for r in reasons[:-1]), reasons
    texts = [e["text"] for e in events]
    assert all(b.startswith(a) for a, b in zip(texts, texts[1:], strict=False))
    assert (events[-1]["text"], events[-1]["output_ids"]) == (want_text, want_ids)


def _check_completion(events: list[dict], want_text: str) -> str:
    ids = {e["id"] for e in events}
    assert len(ids) == 1
    reasons = [e["choices"][0]["finish_reason"] for e in events]
    assert reasons[-1] == "length" and all(r is None for r in reasons[:-1]), reasons
    assert "".join(e["choices"][0]["text"] for e in events) == want_text
    return ids.pop()


def test_three_waves_of_concurrent_streams_lose_nothing_and_hold_rss_flat(
    load_server, reference_llm
) -> None:
    refs = reference_llm.generate(PROMPTS, SamplingParams(max_tokens=NEW_TOKENS,
                                                          temperature=0.0, ignore_eos=True))
    completion_ids: set[str] = set()
    rss: list[int] = []

    port = int(load_server.url.rsplit(":", 1)[1])

    async def wave(w: int) -> None:
        jobs = []
        for i in range(CONCURRENT):
            prompt = PROMPTS[i % len(PROMPTS)]
            if i % 2:
                jobs.append(_stream(port, "/v1/completions", _completion_body(prompt)))
            else:
                jobs.append(_stream(port, "/generate", _generate_body(f"w{w}-{i}", prompt)))
        results = await asyncio.gather(*jobs)
        for i, events in enumerate(results):
            ref = refs[i % len(PROMPTS)]
            if i % 2:
                completion_ids.add(_check_completion(events, ref.text))
            else:
                _check_generate(f"w{w}-{i}", events, ref.text, ref.token_ids)

    async def run() -> None:  # (reads ``metrics``, the client opened around it)
        for w in range(WAVES):
            before = scrape(metrics)
            started = time.perf_counter()
            await wave(w)
            print(f"wave {w}: {time.perf_counter() - started:.1f} s")
            after = scrape(metrics)
            made = after["kvrunner_generation_tokens_total"] - \
                before["kvrunner_generation_tokens_total"]
            assert made == CONCURRENT * NEW_TOKENS  # none lost, none run twice
            assert after["kvrunner_requests_aborted_total"] == \
                before["kvrunner_requests_aborted_total"]
            assert (after["kvrunner_num_requests_running"],
                    after["kvrunner_num_requests_waiting"],
                    after["kvrunner_kv_blocks_used"]) == (0, 0, 0)
            rss.append(load_server.rss_kib())

    with load_server.client() as metrics:
        asyncio.run(run())
    assert len(completion_ids) == WAVES * CONCURRENT // 2  # no id served twice
    print(f"server RSS after each wave: {rss} KiB")
    measured = rss[1:]  # rss[0] is after the warm-up wave
    assert max(measured[1:]) - measured[0] <= RSS_GROWTH_KIB, rss
