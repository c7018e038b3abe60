"""A dead engine is a dead server. When a tensor-parallel rank dies, the requests in
flight fail with an error naming the rank, ``/health`` answers 503, every later
request is refused, and ``kvrunner serve`` exits non-zero within
:data:`EXIT_WITHIN_S` so that a supervisor restarts it.

Two ranks on gloo; a rank is killed with SIGKILL (no report: the driver finds the
process gone). In process, behind the app (``/health`` and the refusals, a rank
killed while the engine is idle); and as a live server (a rank killed mid-step,
then the exit).
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from pathlib import Path

import httpx
import pytest
from serve_kit import API_KEY, ENGINE_KWARGS, ServeProcess, alive, descendants, start_server

from kvrunner import AsyncLLM, EngineDeadError
from kvrunner.serve import ServeSettings, build_app

EXIT_WITHIN_S = 30.0
TP2 = {"tensor_parallel_size": 2, "distributed_backend": "gloo"}
TP2_FLAGS = ["--tensor-parallel-size", "2", "--distributed-backend", "gloo"]


def _rank_pids(server_pid: int) -> list[int]:
    """The server's spawned rank processes (not the resource tracker or others)."""
    ranks = []
    for pid in descendants(server_pid):
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        if b"spawn_main" in cmdline:
            ranks.append(pid)
    return sorted(ranks)


def test_an_idle_engine_losing_a_rank_answers_503_and_refuses_requests(serve_home) -> None:
    async def run() -> None:
        engine = AsyncLLM(**ENGINE_KWARGS, **TP2)
        try:
            app = build_app(engine, ServeSettings())
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
                assert (await client.get("/health")).status_code == 200
                os.kill(engine._engine.llm.executor.procs.pids[1], signal.SIGKILL)
                deadline = time.monotonic() + 10
                while not engine.errored and time.monotonic() < deadline:
                    await asyncio.sleep(0.05)
                assert engine.errored, "the engine did not notice its rank died"
                health = await client.get("/health")
                assert health.status_code == 503
                message = health.json()["error"]["message"]
                assert "tensor-parallel rank 1" in message and "ProcessDied" in message
                refused = await client.post("/generate", json={
                    "input_ids": [1, 2], "sampling_params": {"max_new_tokens": 2}})
                assert refused.status_code == 503, refused.text
                assert "the engine is dead" in refused.json()["error"]["message"]
            with pytest.raises(EngineDeadError, match="tensor-parallel rank 1"):
                await engine.generate([1, 2])
        finally:
            await engine.shutdown()

    asyncio.run(run())


def test_a_server_losing_a_rank_mid_step_fails_the_request_and_exits_non_zero(
        tmp_path_factory, serve_home) -> None:
    server: ServeProcess = start_server(tmp_path_factory.mktemp("dead_logs"), serve_home,
                                        "dead", TP2_FLAGS, api_key=API_KEY).wait_ready()
    ranks = _rank_pids(server.pid)
    assert len(ranks) == 2, ranks
    body = {"input_ids": [5, 6, 7], "stream": True,
            "sampling_params": {"max_new_tokens": 2000, "ignore_eos": True}}
    events: list[str] = []
    with server.client() as client, client.stream("POST", "/generate", json=body) as stream:
        for line in stream.iter_lines():
            if not line:
                continue
            events.append(line)
            if len(events) == 3:  # generating: a step is in flight
                os.kill(ranks[1], signal.SIGKILL)
                killed = time.monotonic()
    # the killed rank is one of the two (pid order need not be rank order)
    errors = [e for e in events if '"error"' in e]
    assert errors and "tensor-parallel rank " in errors[0] and "ProcessDied" in errors[0]
    assert events[-1] == "data: [DONE]"
    # from the request's failure on, /health is never 200: 503, until nothing answers
    answers = []
    while server.proc.poll() is None and time.monotonic() - killed < EXIT_WITHIN_S:
        try:
            answers.append(httpx.get(server.url + "/health", headers=server.headers(),
                                     timeout=5).status_code)
        except httpx.TransportError:
            answers.append(None)
        time.sleep(0.05)
    assert set(answers) <= {503, None}, answers
    code = server.proc.wait(timeout=max(1.0, EXIT_WITHIN_S - (time.monotonic() - killed)))
    took = time.monotonic() - killed
    assert code != 0 and took < EXIT_WITHIN_S, (code, took)
    log = server.log()
    assert "the engine is dead" in log and "tensor-parallel rank " in log, log
    assert "Traceback" not in log, log
    left = [pid for pid in ranks if alive(pid)]
    assert not left, f"rank processes outlived the server: {left}"
