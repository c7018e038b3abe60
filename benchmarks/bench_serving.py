"""The rollout server's cost: one engine driven every way an RL framework drives it,
plain and with penalised sampling, latency under load, and the wake-to-first-token
time of a paused and updated server, in one run.

Random checkpoint of the Qwen3-0.6B shape (bench_e2e_decode's), bf16, on one GPU:

- the RL-shaped rollout of bench_rollout.py (batch 256, prompts of 1,024 random tokens,
  512 new, seeded T = 1.0, one seed per request) on the same ``LLM``, each way from a
  cold prefix cache: ``LLM.generate``; ``AsyncLLM`` with 256 concurrent ``generate``
  calls; the HTTP server (``kvrunner.serve``'s app, uvicorn, in this process as
  ``kvrunner serve`` runs it) through SGLang's ``/generate``, through
  ``/v1/completions`` and through vLLM's tokens-in, tokens-out
  ``/inference/v1/generate`` (the body TRL's and verifiers' clients send), 256
  requests at once from a client in another process.
- the same rollout penalised (:data:`PENALTIES`: ``repetition_penalty``,
  ``presence_penalty``, ``frequency_penalty`` and ``min_p`` at non-neutral values):
  ``LLM.generate`` (the bound of the penalised rows; beside the plain
  ``LLM.generate`` it gives the penalties' own cost), then over HTTP through
  ``/inference/v1/generate`` and ``/v1/completions``.

  Generated tokens/s of each row, its ratio to its bound (``LLM.generate``, plain or
  penalised; target: the HTTP and ``AsyncLLM`` rows within 5%, the rows a vLLM
  client sends within 3%) and to bench_rollout's HBM/FLOP floor. An HTTP row also
  gives its seconds at the server (first arrival to last answer sent) and the two
  ends of them the engine does not set: how long the batch took to arrive, and how
  long its answers took to leave. ``--http-rounds N`` runs the HTTP ways N times in
  turn.
- time to first token and inter-token latency (p50 / p99) of streamed
  ``/v1/completions`` (prompts of 1,024, 128 new) under Poisson arrivals at three
  rates.
- the slime-shaped cycle over HTTP: pause, release memory, resume weights, update
  from disk, resume the KV cache, continue, one request; the seconds from the first
  resume to that request's first token.

Every row runs once the process's started heap is frozen, as ``kvrunner serve`` freezes
its own (``kvrunner.process_heap``: the collector's full walks skip the objects alive
once the engine is up); ``--unfrozen-heap`` runs them with the collector walking the
whole heap, as in a user's process that builds an ``LLM``.

``--small`` runs the same on the CPU with the embedded tiny model in a few seconds
(tests/benchmarks/test_bench_serving.py); its figures say nothing about speed.
The HTTP parts need fastapi, uvicorn, prometheus-client and aiohttp (``kvrunner[serve]``
and aiohttp, the client); without them they are skipped, saying so.

    python benchmarks/bench_serving.py [--small] [--rates 4,16,64] [--skip-latency]
                                      [--http-rounds N] [--unfrozen-heap]
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import gc
import importlib
import multiprocessing
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import attrs
import torch

from kvrunner import LLM, AsyncLLM, SamplingParams, process_heap

HTTP_MODULES = ("fastapi", "uvicorn", "prometheus_client", "aiohttp")
SERVED_NAME = "served"
BF16_TFLOPS = 790.0
#: the penalised rows' sampling (vLLM's names and rules), each off its neutral value
PENALTIES = {"repetition_penalty": 1.1, "presence_penalty": 0.5, "frequency_penalty": 0.5,
             "min_p": 0.05}
PLAIN_BOUND = "LLM.generate"
PENALISED_BOUND = "LLM.generate, penalised"


@attrs.frozen(kw_only=True)
class Shape:
    """One run's sizes."""

    batch: int
    prompt: int
    new: int
    #: the latency part: prompt and new tokens of each streamed request
    serve_prompt: int
    serve_new: int
    #: seconds of Poisson arrivals per rate
    arrival_s: float
    rates: tuple[float, ...]


H200 = Shape(batch=256, prompt=1024, new=512, serve_prompt=1024, serve_new=128,
             arrival_s=15.0, rates=(4.0, 16.0, 64.0))
SMALL = Shape(batch=8, prompt=16, new=8, serve_prompt=12, serve_new=4, arrival_s=0.5,
              rates=(8.0, 16.0, 32.0))


def missing_http_modules() -> list[str]:
    """The HTTP parts' modules (or the dependencies they name) that do not import."""
    missing = []
    for name in HTTP_MODULES:
        try:
            importlib.import_module(name)
        except ImportError as e:
            missing.append(name if e.name in (None, name) else f"{name} (needs {e.name})")
    return missing


def random_prompts(count: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(1, vocab, (count, length), generator=g).tolist()


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    if len(values) == 1:
        return values[0]
    return statistics.quantiles(values, n=100, method="inclusive")[round(q) - 1]


@attrs.define
class Row:
    way: str
    tokens: int
    seconds: float
    #: HTTP rows: from the first request's arrival at the server to its last answer sent
    server_s: float | None = None
    #: HTTP rows: from the first request's arrival to the last's, and from the first
    #: answer sent to the last (the ends of server_s the engine does not set)
    arrive_s: float | None = None
    leave_s: float | None = None
    #: the row whose tok/s this one is held to (its way)
    bound: str = PLAIN_BOUND
    #: the least tok/s over the bound's that meets the target (None: no target)
    target: float | None = None


def llm_generate(llm: LLM, prompts: list[list[int]], params: list[SamplingParams],
                 way: str = PLAIN_BOUND) -> Row:
    llm.reset_prefix_cache()
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    sync()
    start = time.perf_counter()
    outs = llm.generate(prompts, params)
    sync()
    return Row(way, sum(len(o.token_ids) for o in outs), time.perf_counter() - start)


async def async_generate(engine: AsyncLLM, prompts: list[list[int]],
                         params: list[SamplingParams]) -> Row:
    await engine.generate(prompts[0][:8], SamplingParams(max_tokens=2))  # the thread's first
    await engine.reset_prefix_cache()
    start = time.perf_counter()
    outs = await asyncio.gather(*(engine.generate(p, sp) for p, sp in zip(prompts, params,
                                                                          strict=True)))
    return Row(f"AsyncLLM, {len(prompts)} calls", sum(len(o.token_ids) for o in outs),
               time.perf_counter() - start, target=0.95)


class LocalServer:
    """``kvrunner.serve``'s app on uvicorn, in this process and on this loop, on a free
    port of 127.0.0.1, with the control routes on."""

    def __init__(self, engine: AsyncLLM) -> None:
        import uvicorn

        from kvrunner.serve.app import build_app
        from kvrunner.serve.settings import ServeSettings

        settings = ServeSettings(port=0, enable_rl_endpoints=True,
                                 served_model_name=SERVED_NAME, max_n=1)
        self.exchanges: list[tuple[float, float]] = []
        config = uvicorn.Config(self._timed(build_app(engine, settings)), host="127.0.0.1",
                                port=0, log_level="warning", access_log=False,
                                lifespan="off", backlog=4096)
        self.server = uvicorn.Server(config)
        self.task: asyncio.Task | None = None
        self.url = ""

    def _timed(self, app: Any) -> Any:
        """``app``, noting each HTTP exchange's (arrival, last body bytes handed to the
        server) times."""
        async def timed(scope: dict, receive: Any, send: Any) -> None:
            if scope["type"] != "http":
                return await app(scope, receive, send)
            arrived = time.perf_counter()

            async def noted_send(message: dict) -> None:
                if message["type"] == "http.response.body" and not message.get("more_body"):
                    # noted as the answer's last bytes are handed over: the client cannot
                    # have them yet (after the send, this process may be descheduled past
                    # the client's own end)
                    self.exchanges.append((arrived, time.perf_counter()))
                await send(message)

            await app(scope, receive, noted_send)

        return timed

    def window(self, count: int) -> float:
        """Seconds from the first arrival to the last answer of the last ``count``
        exchanges to arrive."""
        last = sorted(self.exchanges)[-count:]
        return max(end for _, end in last) - last[0][0]

    def spread(self, count: int) -> tuple[float, float]:
        """Of the last ``count`` exchanges to arrive: seconds from the first arrival to
        the last, and from the first answer sent to the last."""
        last = sorted(self.exchanges)[-count:]
        ends = [end for _, end in last]
        return last[-1][0] - last[0][0], max(ends) - min(ends)

    async def start(self) -> str:
        self.task = asyncio.create_task(self.server.serve())
        while not self.server.started:
            if self.task.done():
                self.task.result()  # its error
                raise RuntimeError("the server stopped before it listened")
            await asyncio.sleep(0.01)
        host, port = self.server.servers[0].sockets[0].getsockname()[:2]
        self.url = f"http://{host}:{port}"
        return self.url

    async def stop(self) -> None:
        self.server.should_exit = True
        if self.task is not None:
            await self.task


#: the HTTP rows: (route, penalised, target over the bound)
HTTP_WAYS = (("/generate", False, 0.95), ("/v1/completions", False, 0.95),
             ("/inference/v1/generate", False, 0.97), ("/inference/v1/generate", True, 0.97),
             ("/v1/completions", True, 0.97))


async def http_rows(engine: AsyncLLM, pool: concurrent.futures.Executor, server: LocalServer,
                    prompts: list[list[int]], new: int, rounds: int = 1) -> list[Row]:
    """Every HTTP way, ``rounds`` times in turn (the ways interleaved, so a drift of
    the card's clocks shows in every way alike)."""
    import serving_client

    loop = asyncio.get_running_loop()
    rows = []
    for k in range(rounds):
        for route, penalised, target in HTTP_WAYS:
            await engine.reset_prefix_cache()
            seconds, tokens = await loop.run_in_executor(
                pool, serving_client.rollout, server.url, route, prompts, new,
                PENALTIES if penalised else None)
            arrive_s, leave_s = server.spread(len(prompts))
            rows.append(Row(f"HTTP {route}" + (", penalised" if penalised else "")
                            + (f", round {k + 1}" if rounds > 1 else ""), tokens,
                            seconds, server.window(len(prompts)), arrive_s, leave_s,
                            bound=PENALISED_BOUND if penalised else PLAIN_BOUND,
                            target=target))
    return rows


async def latency_rows(engine: AsyncLLM, pool: concurrent.futures.Executor, url: str,
                       shape: Shape, vocab: int) -> list[dict[str, Any]]:
    import serving_client

    loop = asyncio.get_running_loop()
    rows = []
    for k, rate in enumerate(shape.rates):
        count = max(4, round(rate * shape.arrival_s))
        prompts = random_prompts(count, shape.serve_prompt, vocab, seed=100 + k)
        await engine.reset_prefix_cache()
        got = await loop.run_in_executor(pool, serving_client.poisson, url, prompts,
                                         shape.serve_new, rate, k)
        rows.append({"rate": rate, "requests": count, **got})
    return rows


def print_rollout(rows: list[Row], floor_s: float) -> None:
    """Each row's tok/s over its bound's (the first row of that way), the target that
    ratio must reach, and its seconds over the floor."""
    bounds = {}
    for r in rows:
        bounds.setdefault(r.way, r.tokens / r.seconds)
    print(f"{'way':>38} {'tokens':>8} {'s':>8} {'tok/s':>9} {'bound':>24} {'vs bound':>9} "
          f"{'target':>7} {'floor s':>8} {'s/floor':>8} {'server s':>9} {'server vs bound':>16} "
          f"{'arrive s':>9} {'leave s':>8}")
    for r in rows:
        tps, base = r.tokens / r.seconds, bounds[r.bound]
        target = "" if r.target is None else f">={r.target:.2f}"
        server = ("" if r.server_s is None else
                  f" {r.server_s:>9.3f} {r.tokens / r.server_s / base:>16.3f}"
                  f" {r.arrive_s:>9.3f} {r.leave_s:>8.3f}")
        print(f"{r.way:>38} {r.tokens:>8} {r.seconds:>8.3f} {tps:>9.0f} {r.bound:>24} "
              f"{tps / base:>9.3f} {target:>7} {floor_s:>8.3f} {r.seconds / floor_s:>8.2f}"
              f"{server}")
    print(f"penalised: {', '.join(f'{k}={v}' for k, v in PENALTIES.items())}")


def print_latency(rows: list[dict[str, Any]], new: int) -> None:
    print(f"\nstreamed /v1/completions, {new} new tokens, Poisson arrivals")
    print(f"{'rate/s':>7} {'requests':>8} {'tok/s':>8} {'TTFT p50 ms':>12} {'TTFT p99 ms':>12} "
          f"{'ITL p50 ms':>11} {'ITL p99 ms':>11}")
    for r in rows:
        ttft, itl = r["ttft"], r["itl"]
        print(f"{r['rate']:>7.1f} {r['requests']:>8} {r['tokens'] / r['seconds']:>8.0f} "
              f"{percentile(ttft, 50) * 1e3:>12.1f} {percentile(ttft, 99) * 1e3:>12.1f} "
              f"{percentile(itl, 50) * 1e3:>11.2f} {percentile(itl, 99) * 1e3:>11.2f}")


def print_wake(times: dict[str, float]) -> None:
    print("\npaused, released, updated from disk, woken (HTTP, seconds per call)")
    for name, seconds in times.items():
        print(f"{name:>22} {seconds:>8.3f}")


def rollout_floor(weight_bytes: int, shape: Shape) -> float:
    """bench_rollout.py's floor: each decode step reads the weights and the KV written
    so far once (over the measured copy bandwidth); the prefill does 2 x parameters x
    tokens FLOPs at ~790 bf16 TFLOP/s."""
    from bench_e2e_decode import KV_PER_TOKEN
    from common import copy_bandwidth_tbps

    bw = copy_bandwidth_tbps() * 1e12
    b, p, n = shape.batch, shape.prompt, shape.new
    decode = sum(weight_bytes + b * (p + i) * KV_PER_TOKEN for i in range(n)) / bw
    prefill = 2 * weight_bytes / 2 * b * p / (BF16_TFLOPS * 1e12)
    return decode + prefill


def build(small: bool, shape: Shape) -> tuple[LLM, str, float, int]:
    """The engine, the checkpoint directory, the floor (NaN on the CPU), the vocab size."""
    if small:
        from kvrunner.models.tiny import write_tiny_checkpoint

        path = write_tiny_checkpoint(Path(tempfile.mkdtemp()) / "tiny", kind="qwen3", seed=0)
        llm = LLM(str(path), max_num_seqs=shape.batch, max_model_len=64,
                  max_num_batched_tokens=256, capture_sizes=(1, 2, 4, 8))
        return llm, str(path), float("nan"), llm.engine.vocab_size
    from bench_e2e_decode import SHAPE, write_checkpoint

    path = Path(tempfile.mkdtemp()) / "qwen3-0.6b-random"
    weight_bytes = write_checkpoint(path)
    longest = max(shape.prompt + shape.new, shape.serve_prompt + shape.serve_new) + 16
    llm = LLM(model=str(path), dtype="bfloat16", max_num_seqs=shape.batch,
              max_model_len=longest, max_num_batched_tokens=16384,
              gpu_memory_utilization=0.7)
    return llm, str(path), rollout_floor(weight_bytes, shape), SHAPE["vocab"]


async def served(llm: LLM, path: str, shape: Shape, prompts: list[list[int]],
                 params: list[SamplingParams], args: argparse.Namespace, vocab: int
                 ) -> tuple[list[Row], list[dict[str, Any]], dict[str, float] | None]:
    """The AsyncLLM row and, with the HTTP modules, the HTTP rows, the latency rows and
    the wake cycle."""
    engine = AsyncLLM.from_llm(llm)
    rows = [await async_generate(engine, prompts, params)]
    latency: list[dict[str, Any]] = []
    wake = None
    missing = missing_http_modules()
    if missing:
        print(f"bench_serving: {', '.join(missing)} not installed: the HTTP rows, the "
              f"latency and the wake cycle are skipped (pip install 'kvrunner[serve]' aiohttp)")
        await engine.shutdown()
        return rows, latency, wake
    import serving_client

    server = LocalServer(engine)
    url = await server.start()
    # the client's own process (spawned: this one holds CUDA), started before timing
    with concurrent.futures.ProcessPoolExecutor(
            1, mp_context=multiprocessing.get_context("spawn")) as pool:
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(pool, serving_client.rollout, url, "/generate",
                                   prompts[:2], 2)
        rows += await http_rows(engine, pool, server, prompts, shape.new, args.http_rounds)
        if not args.skip_latency:
            latency = await latency_rows(engine, pool, url, shape, vocab)
        wake = await loop.run_in_executor(pool, serving_client.wake_cycle, url, path,
                                          random_prompts(1, shape.serve_prompt, vocab, 7)[0])
    await server.stop()
    await engine.shutdown()
    return rows, latency, wake


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser()
    ap.add_argument("--small", action="store_true",
                    help="the CPU smoke run: the tiny model, a few seconds")
    ap.add_argument("--rates", default=None,
                    help="Poisson arrival rates, requests/s, comma-separated")
    ap.add_argument("--skip-latency", action="store_true")
    ap.add_argument("--http-rounds", type=int, default=1,
                    help="run the HTTP ways this many times, interleaved")
    ap.add_argument("--unfrozen-heap", action="store_true",
                    help="leave the started heap in the collector's walks")
    args = ap.parse_args(argv)
    shape = SMALL if args.small else H200
    if args.rates:
        shape = attrs.evolve(shape, rates=tuple(float(r) for r in args.rates.split(",")))
    llm, path, floor_s, vocab = build(args.small, shape)
    try:
        prompts = random_prompts(shape.batch, shape.prompt, vocab, seed=1)
        params = [SamplingParams(max_tokens=shape.new, temperature=1.0, seed=i, ignore_eos=True)
                  for i in range(shape.batch)]
        # warm up at the full batch (its prefill and decode shapes), few tokens each
        llm.generate(prompts, [attrs.evolve(p, max_tokens=4) for p in params])
        penalised = [attrs.evolve(p, **PENALTIES) for p in params]
        llm.generate(prompts, [attrs.evolve(p, max_tokens=4) for p in penalised])
        if not args.unfrozen_heap:
            print(f"heap frozen as kvrunner serve freezes it: "
                  f"{process_heap.freeze_started_heap()} objects")
        rows = [llm_generate(llm, prompts, params),
                llm_generate(llm, prompts, penalised, way=PENALISED_BOUND)]
        more, latency, wake = asyncio.run(served(llm, path, shape, prompts, params, args, vocab))
        rows += more
        # the first way again, last: what drifted during the run (clocks, memory) shows
        again = llm_generate(llm, prompts, params)
        rows.append(attrs.evolve(again, way="LLM.generate, again"))
    finally:
        llm.shutdown()
        gc.unfreeze()  # a caller's process (the --small test's) gets its collector back
    print(f"rollout: batch {shape.batch}, prompts of {shape.prompt}, {shape.new} new, "
          f"seeded T=1.0")
    print_rollout(rows, floor_s)
    if latency:
        print_latency(latency, shape.serve_new)
    if wake:
        print_wake(wake)
    return {"rows": rows, "latency": latency, "wake": wake}


if __name__ == "__main__":
    main()
