"""benchmarks/bench_serving.py runs end to end on the CPU (``--small``): every way of
driving the engine, plain and penalised, generates every token, the latency load
answers every request, and the wake cycle over HTTP ends in a first token."""

from __future__ import annotations

import sys
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


def test_the_small_serving_benchmark_drives_one_engine_every_way(capsys) -> None:
    sys.path.insert(0, str(BENCHMARKS))
    try:
        import bench_serving

        got = bench_serving.main(["--small"])
    finally:
        sys.path.remove(str(BENCHMARKS))
    shape = bench_serving.SMALL
    ways = [r.way for r in got["rows"]]
    assert ways == ["LLM.generate", "LLM.generate, penalised", f"AsyncLLM, {shape.batch} calls",
                    "HTTP /generate", "HTTP /v1/completions", "HTTP /inference/v1/generate",
                    "HTTP /inference/v1/generate, penalised", "HTTP /v1/completions, penalised",
                    "LLM.generate, again"]
    # each penalised row is held to the penalised LLM.generate, every other to the plain one
    assert [r.bound for r in got["rows"]] == [
        "LLM.generate" if "penalised" not in r.way or r.way.startswith("LLM")
        else "LLM.generate, penalised" for r in got["rows"]]
    for row in got["rows"]:
        assert row.tokens == shape.batch * shape.new and row.seconds > 0, row
        # the server's own window of an HTTP batch lies inside the client's
        assert (row.server_s is None) == (not row.way.startswith("HTTP")), row
        assert row.server_s is None or 0 < row.server_s <= row.seconds, row
    assert [r["rate"] for r in got["latency"]] == list(shape.rates)
    for r in got["latency"]:
        assert len(r["ttft"]) == r["requests"] and min(r["ttft"]) > 0
        assert r["tokens"] == r["requests"] * shape.serve_new
        assert len(r["itl"]) >= r["requests"]  # more than one event per stream
    wake = got["wake"]
    assert 0 < wake["first token"] < wake["wake_to_first_token"]
    out = capsys.readouterr().out
    assert "vs bound" in out and "penalised: repetition_penalty" in out
    assert "TTFT p50 ms" in out and "wake_to_first_token" in out
