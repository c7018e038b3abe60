"""No import cycles among kvrunner's modules.

The graph is read from the syntax tree: an edge for every import that runs when a
module is imported (not those inside functions or under ``if TYPE_CHECKING``). A
cycle in it is a module that can only be imported because the other half happens to
be loaded first, which a late import or a function-level import hides.
"""

from __future__ import annotations

import graphlib
from pathlib import Path

import pytest
from module_imports import imports, module_name, targets

CORE = Path(__file__).resolve().parents[2] / "core"


def import_graph(root: Path, package: str) -> dict[str, set[str]]:
    """module -> the package's modules it imports at import time."""
    files = {module_name(p, root, package): p for p in sorted(root.rglob("*.py"))}
    known = set(files)
    graph: dict[str, set[str]] = {}
    for name, path in files.items():
        edges: set[str] = set()
        for module, names, _ in imports(path.read_text(), name, path.name == "__init__.py",
                                        top_level_only=True):
            edges |= targets(module, names, known)
        graph[name] = edges - {name}
    return graph


def cycle_in(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of ``graph`` as ``[a, b, ..., a]``, or None when it is acyclic."""
    try:
        tuple(graphlib.TopologicalSorter(graph).static_order())
    except graphlib.CycleError as e:
        return list(e.args[1])
    return None


def test_kvrunner_has_no_import_cycle() -> None:
    graph = import_graph(CORE, "kvrunner")
    assert len(graph) > 100  # the whole package was read, not an empty folder
    cycle = cycle_in(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def _package(tmp_path: Path, files: dict[str, str]) -> Path:
    for rel, text in files.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    return tmp_path


@pytest.mark.parametrize("files", [
    # a late import at the bottom of a module still runs at import time
    {"__init__.py": "", "a.py": "import pkg.b\n", "b.py": "x = 1\nfrom pkg.a import y\n"},
    # through a package: ``from pkg import c`` imports the submodule c
    {"__init__.py": "", "a.py": "from pkg import c\n", "c.py": "from pkg.a import z\n"},
    # relative imports, one inside a try
    {"__init__.py": "", "a.py": "from .b import q\n", "b.py": "try:\n    from . import a\n"
                                                              "except ImportError:\n    pass\n"},
])
def test_a_planted_cycle_is_found(tmp_path: Path, files: dict[str, str]) -> None:
    cycle = cycle_in(import_graph(_package(tmp_path / "pkg", files), "pkg"))
    assert cycle is not None and cycle[0] == cycle[-1] and "pkg.a" in cycle


def test_imports_that_run_later_are_not_edges(tmp_path: Path) -> None:
    files = {"__init__.py": "", "a.py": "import pkg.b\n",
             "b.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import pkg.a\n"
                     "def f():\n    from pkg import a\n"}
    assert cycle_in(import_graph(_package(tmp_path / "pkg", files), "pkg")) is None
