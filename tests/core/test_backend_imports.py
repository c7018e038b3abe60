"""Every backend in the tree imports from kvrunner only through ``kvrunner.plugin_api``.

The plugin API is that one package, versioned as a whole; a backend that reached
into another kvrunner module would depend on what the version does not cover. Read
from the syntax tree of every file of every backend package (``paged``, ``gdn``,
``tbo``, the test fixture backend, the example backend) and of the backend code in
docs/plugins.md, every import, including those inside functions.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from module_imports import imports

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = {
    "paged": ROOT / "backends/paged/kvrunner_paged",
    "gdn": ROOT / "backends/gdn/kvrunner_gdn",
    "tbo": ROOT / "backends/tbo/kvrunner_tbo",
    "flatkv": ROOT / "tests/fixtures/flatkv_backend/kvrunner_flatkv",
    "minimal": ROOT / "examples/minimal_backend/kvrunner_minimal",
}
API = "kvrunner.plugin_api"


def kvrunner_imports_beyond_the_api(source: str, module: str) -> list[str]:
    """Every import of a kvrunner module other than the plugin API, as ``line: module``."""
    wrong = []
    for target, names, line in imports(source, module, False, top_level_only=False):
        reached = {f"{target}.{n}" for n in names} if target == "kvrunner" and names else {target}
        for name in sorted(reached):
            if (name == "kvrunner" or name.startswith("kvrunner.")) and name != API:
                wrong.append(f"{line}: {name}")
    return wrong


def _doc_backend_blocks() -> list[str]:
    docs = (ROOT / "docs/plugins.md").read_text()
    return [b for b in re.findall(r"```python\n(.*?)```", docs, flags=re.S) if "@hookimpl" in b]


@pytest.mark.parametrize("backend", sorted(PACKAGES))
def test_a_backend_package_imports_only_the_plugin_api(backend: str) -> None:
    files = sorted(PACKAGES[backend].rglob("*.py"))
    assert files
    wrong = {str(p.relative_to(ROOT)): kvrunner_imports_beyond_the_api(p.read_text(), backend)
             for p in files}
    assert {path: w for path, w in wrong.items() if w} == {}
    reached = [p for p in files if f"from {API} import" in p.read_text()]
    assert reached  # it does use the API: the walk read real imports


def test_the_backend_code_in_the_docs_imports_only_the_plugin_api() -> None:
    blocks = _doc_backend_blocks()
    assert blocks
    assert [kvrunner_imports_beyond_the_api(b, "docs") for b in blocks] == [[]] * len(blocks)


@pytest.mark.parametrize("line", [
    "import kvrunner.engine",
    "from kvrunner.engine.scheduler import Scheduler",
    "from kvrunner import LLM",
    "from kvrunner.plugin_api.step_data import StepMetadata",
    "def f():\n    from kvrunner.runner import graphs\n",
    "import kvrunner",
])
def test_an_import_beyond_the_api_is_reported(line: str) -> None:
    assert kvrunner_imports_beyond_the_api(line, "x") != []


@pytest.mark.parametrize("line", [
    "from kvrunner.plugin_api import hookimpl",
    "import kvrunner.plugin_api",
    "from kvrunner import plugin_api",
    "import kvrunner_paged.layer",
])
def test_an_import_of_the_api_passes(line: str) -> None:
    assert kvrunner_imports_beyond_the_api(line, "x") == []
