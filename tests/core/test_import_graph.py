"""kvrunner's modules stand on floors: no import cycle, no arrow back up.

The graph (:mod:`import_graph`) has an edge for every import that can run, those
inside functions included: a cycle that closes only inside a function is still a
cycle. The floors are :data:`import_graph.LAYERS`, the map docs/architecture.md draws.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from import_graph import (
    LAYERS,
    back_arrows,
    cycle_in,
    floor_of,
    import_graph,
    sibling_cycles,
    unplaced,
)

CORE = Path(__file__).resolve().parents[2] / "core"


@pytest.fixture(scope="module")
def graph() -> dict[str, set[str]]:
    graph = import_graph(CORE, "kvrunner")
    assert len(graph) > 100  # the whole package was read, not an empty folder
    return graph


def test_kvrunner_has_no_import_cycle(graph: dict[str, set[str]]) -> None:
    cycle = cycle_in(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_every_module_stands_on_a_floor(graph: dict[str, set[str]]) -> None:
    assert unplaced(graph) == [], "add to import_graph.LAYERS"


def test_no_module_imports_a_floor_above_its_own(graph: dict[str, set[str]]) -> None:
    assert back_arrows(graph) == []


def test_sub_packages_of_one_package_import_one_way(graph: dict[str, set[str]]) -> None:
    assert sibling_cycles(graph) == []


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
    # an import inside a function closes the cycle when the function runs
    {"__init__.py": "", "a.py": "import pkg.b\n", "b.py": "def f():\n    from pkg import a\n"},
    # ... and inside a method
    {"__init__.py": "", "a.py": "def g():\n    import pkg.b\n",
     "b.py": "class C:\n    def f(self):\n        from pkg.a import g\n"},
])
def test_a_planted_cycle_is_found(tmp_path: Path, files: dict[str, str]) -> None:
    cycle = cycle_in(import_graph(_package(tmp_path / "pkg", files), "pkg"))
    assert cycle is not None and cycle[0] == cycle[-1] and "pkg.a" in cycle


def test_an_import_that_never_runs_is_no_edge(tmp_path: Path) -> None:
    files = {"__init__.py": "", "a.py": "import pkg.b\n",
             "b.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import pkg.a\n"}
    assert cycle_in(import_graph(_package(tmp_path / "pkg", files), "pkg")) is None


def test_a_planted_arrow_back_up_is_found(tmp_path: Path) -> None:
    layers = (("pkg.top",), ("pkg.low",))
    files = {"__init__.py": "", "top.py": "import pkg.low\n",
             "low.py": "def f():\n    from pkg.top import x\n"}
    graph = import_graph(_package(tmp_path / "pkg", files), "pkg")
    assert back_arrows(graph, layers) == ["pkg.low -> pkg.top"]


def test_a_planted_cycle_between_sibling_packages_is_found(tmp_path: Path) -> None:
    files = {"__init__.py": "", "a/__init__.py": "", "a/x.py": "import pkg.b.y\n",
             "b/__init__.py": "", "b/y.py": "x = 1\n", "b/z.py": "import pkg.a.w\n",
             "a/w.py": "x = 1\n"}
    graph = import_graph(_package(tmp_path / "pkg", files), "pkg")
    assert cycle_in(graph) is None  # no module cycle: only the packages go both ways
    assert sibling_cycles(graph) != []


def test_a_package_entry_covers_its_modules_and_the_longest_entry_wins() -> None:
    assert floor_of("kvrunner.runner.capture.graphs") == floor_of("kvrunner.runner")
    assert floor_of("kvrunner") != floor_of("kvrunner.errors")
    assert floor_of("kvrunner.nowhere_at_all") is None  # the root's entry is its __init__
    assert len({floor_of(name) for entry in LAYERS for name in entry}) == len(LAYERS)
