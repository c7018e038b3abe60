"""The peers' own client packages against a live ``kvrunner serve``.

Each peer's package is pinned and installed by ``.ci/compat.sh`` into a site
directory of its own (``--no-deps``: nothing in the environment is replaced), which
then runs this folder with ``KVRUNNER_COMPAT_SITE`` set. A test module that needs a
peer's package is collected only then (the main suite's environment lacks those
packages by design); the openai SDK is part of the test extra, so its tests run in
the main suite too (tests/serve/test_openai_client.py).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "serve"))
from serve_kit import ENGINE_KWARGS, ServeProcess, start_server  # noqa: E402

#: the modules that drive a peer's package, collected only in the compat stage
PEER_MODULES = ("test_trl_vllm_client.py", "test_areal_remote_engine.py",
                "test_verifiers_train_client.py")


def pytest_ignore_collect(collection_path: Path, config: pytest.Config) -> bool | None:
    if collection_path.name in PEER_MODULES and not os.environ.get("KVRUNNER_COMPAT_SITE"):
        return True
    return None


@pytest.fixture(scope="session")
def compat_home(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    home = tmp_path_factory.mktemp("compat_home")
    previous = os.environ.get("KVRUNNER_HOME")
    os.environ["KVRUNNER_HOME"] = str(home)
    yield home
    if previous is None:
        os.environ.pop("KVRUNNER_HOME", None)
    else:
        os.environ["KVRUNNER_HOME"] = previous


@pytest.fixture(scope="session")
def vllm_like_server(tmp_path_factory: pytest.TempPathFactory, compat_home: Path
                     ) -> Iterator[ServeProcess]:
    """A server as an RL team starts vLLM for TRL: no API key, the RL routes and vLLM's
    weight transfer on (``--weight-transfer-config '{"backend": "nccl"}'``)."""
    from kvrunner.models.tiny import ensure_default_model

    ensure_default_model("tiny-qwen3")
    server = start_server(tmp_path_factory.mktemp("compat_logs"), compat_home, "compat",
                          ["--enable-rl-endpoints", "--weight-transfer-config",
                           '{"backend": "nccl"}'], api_key=None).wait_ready()
    yield server
    assert server.stop() == 0


@pytest.fixture(scope="session")
def reference_llm(compat_home: Path) -> Iterator[object]:
    from kvrunner.llm import LLM

    llm = LLM(**ENGINE_KWARGS)
    yield llm
    llm.shutdown()
