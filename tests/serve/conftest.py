"""Fixtures: the live servers (see serve_kit.py) and an in-process reference ``LLM``."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from serve_kit import API_KEY, ENGINE_KWARGS, SETTING_FLAGS, ServeProcess, running, start_server


@pytest.fixture(scope="session")
def serve_home(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A private home for the embedded model, shared by the servers and the references."""
    home = tmp_path_factory.mktemp("serve_home")
    previous = os.environ.get("KVRUNNER_HOME")
    os.environ["KVRUNNER_HOME"] = str(home)
    yield home
    if previous is None:
        os.environ.pop("KVRUNNER_HOME", None)
    else:
        os.environ["KVRUNNER_HOME"] = previous


@pytest.fixture(scope="session")
def servers(tmp_path_factory: pytest.TempPathFactory, serve_home: Path
            ) -> Iterator[dict[str, ServeProcess]]:
    """Two servers, started side by side: ``rl`` (control routes on, ``--api-key``) and
    ``locked`` (control routes off, the key from ``$KVRUNNER_API_KEY``)."""
    tmp = tmp_path_factory.mktemp("serve_logs")
    from kvrunner.models.tiny import ensure_default_model

    ensure_default_model("tiny-qwen3")  # written once, before two processes race for it
    started = {
        "rl": start_server(tmp, serve_home, "rl", ["--enable-rl-endpoints"], api_key=API_KEY),
        "locked": start_server(tmp, serve_home, "locked", [], api_key=API_KEY + "-env",
                               env_key=True),
    }
    with running(started):
        yield started


@pytest.fixture(scope="session")
def server(servers: dict[str, ServeProcess]) -> ServeProcess:
    return servers["rl"]


@pytest.fixture(scope="session")
def locked_server(servers: dict[str, ServeProcess]) -> ServeProcess:
    return servers["locked"]


@pytest.fixture(scope="session")
def reference_llm(serve_home: Path) -> Iterator[object]:
    """An in-process ``LLM`` with the servers' engine settings."""
    from kvrunner.llm import LLM

    llm = LLM(**ENGINE_KWARGS)
    yield llm
    llm.shutdown()


@pytest.fixture(scope="session")
def deterministic_server(tmp_path_factory: pytest.TempPathFactory, serve_home: Path
                         ) -> Iterator[ServeProcess]:
    """A server with ``--deterministic`` (batch-invariant: a request's bits do not depend
    on what shares its steps), the shared engine flags otherwise."""
    server = start_server(tmp_path_factory.mktemp("deterministic_logs"), serve_home,
                          "deterministic", [], api_key=API_KEY,
                          engine_flags=[*SETTING_FLAGS, "--deterministic"]).wait_ready()
    yield server
    assert server.stop() == 0
