"""The README's HTTP example, pasted as a new user would: its shell block prints both
answers (it waits for the server before the first curl), its ``openai`` line works
with what the ``serve`` extra installs, and the block stops waiting when the server
cannot start."""

from __future__ import annotations

import json
import re
import shutil
import socket
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from serve_kit import server_env

ROOT = Path(__file__).resolve().parents[2]
#: the README's block runs curl, as the user's shell would
needs_curl = pytest.mark.skipif(shutil.which("curl") is None, reason="needs curl")
README = (ROOT / "README.md").read_text()


def _http_block() -> str:
    after = README[README.index("Over HTTP"):]
    return re.search(r"```bash\n(.*?)```", after, re.S).group(1)


def _openai_line() -> str:
    after = README[README.index("Over HTTP"):]
    return re.search(r"`(openai\.OpenAI\(.*?)`", after).group(1)


def _json_objects(text: str) -> list[dict]:
    """Every JSON object printed in ``text``, in order."""
    decoder, found, at = json.JSONDecoder(), [], text.find("{")
    while at != -1:
        value, end = decoder.raw_decode(text, at)
        found.append(value)
        at = text.find("{", end)
    return found


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _script(port: int) -> str:
    block = _http_block().replace("8000", str(port))
    line = _openai_line().replace("8000", str(port))
    # the user's shell: the pasted block, then the openai line, then the server stopped
    return (f"{block}\n{sys.executable} -c 'import openai; print(\"OPENAI\", "
            f"{line}.choices[0].text is not None)'\nkill %1; wait\n")


@needs_curl
def test_the_readme_block_waits_for_the_server_and_prints_both_answers(tmp_path) -> None:
    port = _free_port()
    bin_dir = Path(sys.executable).parent
    env = server_env(tmp_path) | {"PATH": f"{bin_dir}:/usr/bin:/bin"}
    done = subprocess.run(["bash", "-c", _script(port)], capture_output=True, text=True,
                          timeout=300, env=env)
    answers = _json_objects(done.stdout)  # curl ends its answers with no newline
    assert len(answers) == 2, (done.stdout, done.stderr)
    completion, generate = answers
    assert completion["usage"]["completion_tokens"] == 8
    assert len(generate["output_ids"]) == 8
    assert "OPENAI True" in done.stdout, done.stderr


@needs_curl
def test_the_readme_block_stops_waiting_when_the_server_cannot_start(tmp_path) -> None:
    with socket.socket() as taken:  # bound, not listening: a curl there is refused
        taken.bind(("127.0.0.1", 0))
        port = taken.getsockname()[1]
        block = _http_block().replace("8000", str(port))
        env = server_env(tmp_path) | {"PATH": f"{Path(sys.executable).parent}:/usr/bin:/bin"}
        done = subprocess.run(["bash", "-c", block], capture_output=True, text=True,
                              timeout=120, env=env)
    assert f"cannot listen on 127.0.0.1:{port}" in done.stderr


def test_the_serve_extra_brings_the_openai_client_the_readme_uses() -> None:
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    serve = config["project"]["optional-dependencies"]["serve"]
    assert _openai_line().startswith("openai.")
    assert any(re.match(r"openai\b", dep) for dep in serve), serve
    assert "pip install -e '.[serve]'" in README[:README.index("Over HTTP") + 200]
