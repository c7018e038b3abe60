"""The core imports without the ``serve`` extra, and ``kvrunner serve`` then says which
extra to install.

A fresh interpreter with an import hook that refuses fastapi, uvicorn,
prometheus-client (and what comes with them: starlette, jinja2) stands for an
install without ``kvrunner[serve]``.
"""

from __future__ import annotations

import subprocess
import sys

BLOCKED = ("fastapi", "uvicorn", "prometheus_client", "starlette", "jinja2")

_BLOCK = f"""
import importlib.abc, sys

class NotInstalled(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in {BLOCKED!r}:
            raise ModuleNotFoundError(f"No module named {{name!r}}", name=name)
        return None

sys.meta_path.insert(0, NotInstalled())
"""


def _run(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", _BLOCK + code], capture_output=True,
                          text=True, timeout=120)


def test_the_import_hook_really_blocks_the_extra() -> None:
    done = _run("import fastapi")
    assert done.returncode != 0 and "No module named 'fastapi'" in done.stderr


def test_kvrunner_llm_and_asyncllm_import_without_the_serve_extra() -> None:
    done = _run(
        "import kvrunner\n"
        "from kvrunner import LLM, AsyncLLM, SamplingParams\n"
        "assert LLM.__name__ == 'LLM' and AsyncLLM.__name__ == 'AsyncLLM'\n"
        f"loaded = sorted(m for m in sys.modules if m.split('.')[0] in {BLOCKED!r})\n"
        "assert not loaded, loaded\n"
        "print('imported')\n"
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "imported"


def test_kvrunner_serve_names_the_extra_to_install() -> None:
    done = _run("from kvrunner.cli.main import main\n"
                "sys.exit(main(['serve', '--model', 'tiny-qwen3', '--port', '0']))\n")
    assert done.returncode == 2, (done.returncode, done.stdout, done.stderr)
    assert "pip install 'kvrunner[serve]'" in done.stderr
    assert any(name in done.stderr for name in BLOCKED), done.stderr
    assert "Traceback" not in done.stderr
