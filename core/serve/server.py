"""The ``kvrunner serve`` process: bind the port, load the engine, serve HTTP until
SIGTERM, stop clean.

One asyncio loop runs both uvicorn and the ``AsyncLLM`` front. SIGTERM (or Ctrl-C) runs
:class:`~kvrunner.serve.shutdown.GracefulShutdown` first and only then lets uvicorn
close its connections; a second signal forces the exit. The engine is shut down last,
which frees the device and stops every tensor-parallel rank process, so the process
exits with nothing left behind. An engine that dies (a rank lost) stops the server
too, and the process exits non-zero (``ENGINE_DIED``).
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import signal
import socket
import sys
from collections.abc import Callable, Iterator
from types import FrameType
from typing import Any

import uvicorn

from kvrunner import process_heap
from kvrunner.async_engine.errors import EngineClosedError
from kvrunner.errors import KvrunnerError
from kvrunner.serve.app import build_app
from kvrunner.serve.settings import ServeSettings
from kvrunner.serve.shutdown import GracefulShutdown

_SIGNALS = (signal.SIGTERM, signal.SIGINT)
#: how long uvicorn waits for connections once every request has ended
CLOSE_TIMEOUT_S = 10.0
#: seconds between two looks at whether the engine died
WATCHDOG_S = 0.25
#: the exit status of a server whose engine died
ENGINE_DIED = 1


class _Server(uvicorn.Server):
    """uvicorn's server whose first SIGTERM empties the engine before it stops."""

    def __init__(self, config: uvicorn.Config, shutdown: GracefulShutdown,
                 announce: Callable[[str], None]) -> None:
        super().__init__(config)
        self._graceful = shutdown
        self._announce = announce
        self._loop: asyncio.AbstractEventLoop | None = None
        self._emptying: asyncio.Task | None = None
        self._watchdog: asyncio.Task | None = None
        #: the process's exit status: 0, or ENGINE_DIED
        self.exit_code = 0

    async def startup(self, sockets: Any = None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().startup(sockets=sockets)
        if self.started and self.servers:
            host, port = self.servers[0].sockets[0].getsockname()[:2]
            self._announce(f"http://{host}:{port}")
            self._watchdog = asyncio.ensure_future(self._watch_engine())

    async def shutdown(self, sockets: Any = None) -> None:
        if self._watchdog is not None:
            self._watchdog.cancel()
        await super().shutdown(sockets=sockets)

    async def _watch_engine(self) -> None:
        """A dead engine is a dead server: once the engine can serve nothing more (a
        rank died; the requests in flight have failed with the cause and /health
        answers 503), stop serving and exit with ENGINE_DIED, so a supervisor
        restarts the process."""
        engine = self._graceful.engine
        while engine.dead_error is None:
            await asyncio.sleep(WATCHDOG_S)
        self._graceful.admission.open = False
        print(f"kvrunner serve: {engine.dead_error}; exiting with status {ENGINE_DIED}",
              file=sys.stderr, flush=True)
        self.exit_code = ENGINE_DIED
        self.should_exit = True

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        # uvicorn's own re-raises the signal after serving, which would kill the process
        # before the engine (and its rank processes) is shut down
        previous = {sig: signal.signal(sig, self.handle_exit) for sig in _SIGNALS}
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self._emptying is None and self._loop is not None and not self.should_exit:
            self._loop.call_soon_threadsafe(self._begin)
            return
        self.should_exit = True
        self.force_exit = True  # a second signal: stop now

    def _begin(self) -> None:
        self._emptying = asyncio.ensure_future(self._empty())

    async def _empty(self) -> None:
        try:
            aborted = await self._graceful.empty_engine()
            print(f"kvrunner serve: shutting down ({aborted} request(s) aborted)",
                  file=sys.stderr, flush=True)
        except EngineClosedError:  # the engine died first: its requests have failed
            pass
        finally:
            self.should_exit = True


def _announce(url: str) -> None:
    # the one line a supervisor (or a test) waits for: where the server listens
    print(f"kvrunner serve: listening on {url}", flush=True)


class PortError(KvrunnerError):
    """The server's address cannot be bound; the message is the one line to print."""


def bind_port(host: str, port: int) -> socket.socket:
    """A TCP socket bound to ``host:port`` (not yet listening); :class:`PortError`, one
    line naming the address, when it cannot be had (taken, not this host's, no
    permission)."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(
            host, port, type=socket.SOCK_STREAM, proto=socket.IPPROTO_TCP)[0]
    except socket.gaierror as e:
        raise PortError(f"kvrunner serve: cannot listen on {host}:{port}: the host "
                        f"{host!r} does not resolve ({e.strerror}); see --host") from None
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # past TIME_WAIT only
    try:
        sock.bind(address)
    except OSError as e:
        sock.close()
        hint = "another process listens there; pick a free one with --port (0: any)" \
            if e.errno == errno.EADDRINUSE else "see --host and --port"
        raise PortError(f"kvrunner serve: cannot listen on {host}:{port}: {e.strerror} "
                        f"({hint})") from None
    return sock


async def _serve(settings: ServeSettings, make_engine: Callable[[], Any],
                 sock: socket.socket) -> int:
    engine = make_engine()
    try:
        app = build_app(engine, settings)
        # the engine is up: its start-up heap leaves the collector's walks
        process_heap.freeze_started_heap()
        config = uvicorn.Config(app, host=settings.host, port=settings.port,
                                log_level=settings.log_level, access_log=False,
                                timeout_graceful_shutdown=int(CLOSE_TIMEOUT_S), lifespan="off",
                                backlog=4096)
        server = _Server(config, app.state.server.shutdown, _announce)
        try:
            await server.serve(sockets=[sock])
        finally:
            if app.state.server.tokens is not None:
                app.state.server.tokens.close()
        if not server.started:
            print(f"kvrunner serve: could not listen on {settings.host}:{settings.port}",
                  file=sys.stderr)
            return 1
        return server.exit_code
    finally:
        await engine.shutdown()


def serve_forever(settings: ServeSettings, make_engine: Callable[[], Any]) -> int:
    """Bind the port, load the engine with ``make_engine()``, serve until SIGTERM; the
    exit status.

    The port is bound before the model loads, so a busy port costs no load: the
    process prints one line naming the address and exits 1. A SIGTERM while the
    model loads ends the process through ``SystemExit``, so the engine's clean-up
    (its rank processes) still runs.
    """
    try:
        sock = bind_port(settings.host, settings.port)
    except PortError as e:
        print(e, file=sys.stderr)
        return 1

    def _stop_loading(sig: int, _frame: FrameType | None) -> None:
        raise SystemExit(128 + sig)

    for sig in _SIGNALS:
        signal.signal(sig, _stop_loading)
    with sock:
        return asyncio.run(_serve(settings, make_engine, sock))
