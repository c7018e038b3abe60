"""A request body is parsed where it cannot stall the server: a small one in place,
one of ``OFF_LOOP_BYTES`` or more in a worker thread, with the same result and the
same 400 for a bad one."""

from __future__ import annotations

import asyncio
import json
import threading

import pytest
from pydantic import BaseModel

from kvrunner.serve.body import OFF_LOOP_BYTES, off_loop, parse_json
from kvrunner.serve.errors import APIError


class Prompt(BaseModel):
    input_ids: list[int]


def parse_recording_thread(seen: list[int]):
    def parse(raw: bytes) -> Prompt:
        seen.append(threading.get_ident())
        return parse_json(raw, Prompt)
    return parse


def big_body() -> bytes:
    raw = json.dumps({"input_ids": list(range(OFF_LOOP_BYTES // 6))}).encode()
    assert len(raw) >= OFF_LOOP_BYTES
    return raw


def test_a_small_body_is_parsed_on_the_loop_and_a_big_one_off_it() -> None:
    seen: list[int] = []

    async def run() -> tuple[int, Prompt, Prompt]:
        small = await off_loop(b'{"input_ids": [1, 2]}', parse_recording_thread(seen))
        big = await off_loop(big_body(), parse_recording_thread(seen))
        return threading.get_ident(), small, big

    loop_thread, small, big = asyncio.run(run())
    assert small.input_ids == [1, 2]
    assert big.input_ids == list(range(OFF_LOOP_BYTES // 6))
    assert seen[0] == loop_thread and seen[1] != loop_thread


def test_a_big_bad_body_is_the_same_400_off_the_loop() -> None:
    raw = big_body()[:-1]  # cut: not JSON any more
    with pytest.raises(APIError, match="not valid JSON") as in_place:
        parse_json(raw, Prompt)
    with pytest.raises(APIError, match="not valid JSON") as off:
        asyncio.run(off_loop(raw, lambda r: parse_json(r, Prompt)))
    assert (off.value.status, str(off.value)) == (in_place.value.status, str(in_place.value))
