"""Live ``kvrunner serve`` processes for the HTTP tests (the fixtures are in conftest.py).

Each server is a real subprocess (``python -m kvrunner.cli.main serve --port 0``) serving
the embedded ``tiny-qwen3`` on 127.0.0.1; the fixture reads the URL it prints, waits
for ``/health``, and at teardown sends SIGTERM and checks that the process exited 0
with every process it started (tensor-parallel ranks included) gone.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx

API_KEY = "test-key-1234"
#: engine flags every test server and every in-process reference LLM share, so that
#: their tokens and logprobs can be compared
ENGINE_FLAGS = ["--model", "tiny-qwen3", "--seed", "0", "--max-num-seqs", "64",
                "--capture-sizes", "1,2,4,8"]
#: the engine flags without the model, for a server of another checkpoint
SETTING_FLAGS = ENGINE_FLAGS[2:]
ENGINE_KWARGS = {"model": "tiny-qwen3", "seed": 0, "max_num_seqs": 64,
                 "capture_sizes": (1, 2, 4, 8)}
START_TIMEOUT_S = 300


def descendants(pid: int) -> set[int]:
    """Every live descendant of ``pid`` (from /proc: parent links)."""
    parents: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        # the command name is in parentheses and may hold spaces: split after it
        fields = stat[stat.rfind(")") + 2:].split()
        parents[int(entry.name)] = int(fields[1])
    found: set[int] = set()
    frontier = [pid]
    while frontier:
        parent = frontier.pop()
        kids = [p for p, pp in parents.items() if pp == parent and p not in found]
        found.update(kids)
        frontier.extend(kids)
    return found


def alive(pid: int) -> bool:
    """Running (a zombie, exited but not yet reaped, is not)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rfind(")") + 2:].split()[0] != "Z"


class ServeProcess:
    """One ``kvrunner serve`` subprocess."""

    def __init__(self, flags: list[str], *, env: dict[str, str], log: Path,
                 api_key: str | None) -> None:
        self.flags = flags
        self.env = env
        self.log_path = log
        self.api_key = api_key
        self.url = ""
        self.proc: subprocess.Popen | None = None
        self._lines: queue.Queue[str] = queue.Queue()

    def start(self) -> ServeProcess:
        self._log = open(self.log_path, "w")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "kvrunner.cli.main", "serve", "--port", "0", *self.flags],
            stdout=subprocess.PIPE, stderr=self._log, text=True, env=self.env,
        )
        threading.Thread(target=self._read, daemon=True).start()
        return self

    def _read(self) -> None:
        assert self.proc is not None and self.proc.stdout is not None
        for line in self.proc.stdout:
            self._lines.put(line)

    def log(self) -> str:
        return self.log_path.read_text()[-4000:]

    def wait_ready(self) -> ServeProcess:
        deadline = time.monotonic() + START_TIMEOUT_S
        while not self.url:
            try:
                line = self._lines.get(timeout=1.0)
            except queue.Empty:
                line = ""
            if "listening on " in line:
                self.url = line.split("listening on ", 1)[1].strip()
            assert self.proc is not None
            if self.proc.poll() is not None:
                raise AssertionError(f"kvrunner serve exited {self.proc.returncode}:\n"
                                     f"{self.log()}")
            if time.monotonic() > deadline:
                raise AssertionError(f"kvrunner serve did not start:\n{self.log()}")
        response = httpx.get(self.url + "/health", headers=self.headers(), timeout=60)
        assert response.status_code == 200, response.text
        return self

    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def client(self, **kwargs: object) -> httpx.Client:
        return httpx.Client(base_url=self.url, headers=self.headers(), timeout=120, **kwargs)

    def async_client(self, **kwargs: object) -> httpx.AsyncClient:
        return httpx.AsyncClient(base_url=self.url, headers=self.headers(), timeout=120,
                                 **kwargs)

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def rss_kib(self) -> int:
        """The server's resident set (VmRSS in /proc/PID/status), KiB."""
        for line in Path(f"/proc/{self.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
        raise AssertionError("no VmRSS line")

    def stop(self, timeout: float = 120.0) -> int:
        """SIGTERM; the exit status. Fails if any process it started outlives it."""
        assert self.proc is not None
        started = descendants(self.pid)
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            code = self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            for pid in started:
                if alive(pid):
                    os.kill(pid, signal.SIGKILL)
            raise AssertionError(f"kvrunner serve ignored SIGTERM for {timeout} s:\n"
                                 f"{self.log()}") from None
        finally:
            self._log.close()
        deadline = time.monotonic() + 10
        while any(alive(p) for p in started) and time.monotonic() < deadline:
            time.sleep(0.1)
        left = sorted(p for p in started if alive(p))
        for pid in left:  # not to leak them into the rest of the run
            os.kill(pid, signal.SIGKILL)
        assert not left, f"processes left behind by kvrunner serve: {left}\n{self.log()}"
        return code


def server_env(home: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "KVRUNNER_API_KEY"}
    return env | {"KVRUNNER_HOME": str(home)} | extra


@contextlib.contextmanager
def running(servers: dict[str, ServeProcess]) -> Iterator[dict[str, ServeProcess]]:
    """``servers`` (started side by side) once each is ready; at the end every one is
    stopped and must have exited 0."""
    try:
        for server in servers.values():
            server.wait_ready()
        yield servers
    finally:
        codes = {name: server.stop() for name, server in servers.items()}
        assert codes == dict.fromkeys(servers, 0), codes


def start_server(tmp: Path, home: Path, name: str, flags: list[str], *,
                 api_key: str | None, env_key: bool = False, model: str = "tiny-qwen3",
                 engine_flags: list[str] | None = None) -> ServeProcess:
    """A server of ``model`` (a default model's name or a checkpoint directory) with the
    shared engine flags (``engine_flags`` replaces them) and ``flags``."""
    extra = {"KVRUNNER_API_KEY": api_key} if env_key and api_key else {}
    key_flags = ["--api-key", api_key] if api_key and not env_key else []
    settings = SETTING_FLAGS if engine_flags is None else engine_flags
    return ServeProcess(["--model", model, *settings, *key_flags, *flags],
                        env=server_env(home, **extra), log=tmp / f"{name}.log",
                        api_key=api_key).start()


def sse_payloads(lines: list[str]) -> list[object]:
    """The JSON payloads of server-sent event lines, up to ``data: [DONE]``; fails unless
    the stream was closed by ``[DONE]`` (a stream cut short never sends it)."""
    payloads: list[object] = []
    for line in lines:
        if not line:
            continue
        assert line.startswith("data: "), line
        data = line[len("data: "):]
        if data == "[DONE]":
            return payloads
        payloads.append(json.loads(data))
    raise AssertionError(f"the stream ended without data: [DONE] after {payloads[-1:]}")


async def stream_events(client: httpx.AsyncClient, path: str, body: dict,
                        first: asyncio.Event | None = None) -> list[dict]:
    """POST ``body`` with ``stream`` set and read the whole event stream (its payloads);
    ``first`` is set once the first event arrives."""
    lines: list[str] = []
    async with client.stream("POST", path, json=body | {"stream": True}) as response:
        assert response.status_code == 200, await response.aread()
        async for line in response.aiter_lines():
            lines.append(line)
            if first is not None and line.startswith("data: "):
                first.set()
    return sse_payloads(lines)  # type: ignore[return-value]


def scrape(client: httpx.Client) -> dict[str, float]:
    """``/metrics`` as {sample name (with its labels): value}."""
    response = client.get("/metrics")
    assert response.status_code == 200, response.text
    values = {}
    for line in response.text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            values[name] = float(value)
    return values
