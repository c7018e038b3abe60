"""kvrunner's import graph, read from the syntax tree, and the house figures it gives.

An edge for every import that can run: at import time, or inside a function when it
is called (an import hidden in a function is still a dependency: it runs, and a
cycle through it only works while the other half happens to be loaded first). An
import under ``if TYPE_CHECKING`` never runs and is no edge.

The package's floors are :data:`LAYERS`, top to bottom, as import-linter's layers
contract states them: a module may import its own floor and the floors below, never
one above (an *arrow back up*). Within a package, the sub-packages' own graph must
have no cycle either (``runner/capture`` may use ``runner/step``, not both ways).

Run as a script, it prints the figures for a ``core/`` tree:
``python tests/core/import_graph.py [core_dir]``.
"""

from __future__ import annotations

import graphlib
import sys
from pathlib import Path

from module_imports import imports, module_name, targets

#: kvrunner's floors, top to bottom. Each entry is a module or a package (a package
#: stands for everything under it); the root package ``kvrunner`` (its
#: ``__init__``) is the public face and sits near the top.
LAYERS: tuple[tuple[str, ...], ...] = (
    ("kvrunner.cli", "kvrunner.testing"),
    ("kvrunner.serve", "kvrunner.ray"),
    ("kvrunner",),
    ("kvrunner.async_llm", "kvrunner.async_engine"),
    ("kvrunner.launch",),
    ("kvrunner.llm", "kvrunner.call_guard"),
    ("kvrunner.prompts",),
    ("kvrunner.rl", "kvrunner.aligned"),
    ("kvrunner.runner",),
    ("kvrunner.weight_sync",),
    ("kvrunner.plugin_host",),
    ("kvrunner.models", "kvrunner.distributed"),
    ("kvrunner.layers",),
    ("kvrunner.engine",),
    ("kvrunner.plugin_api",),
    ("kvrunner.config", "kvrunner.config_checks"),
    ("kvrunner.errors", "kvrunner.outputs", "kvrunner.sampling_params",
     "kvrunner.structured_outputs", "kvrunner.process_heap", "kvrunner.unicode_text",
     "kvrunner.held_sigint"),
)


def import_graph(root: Path, package: str, *, at_import_only: bool = False
                 ) -> dict[str, set[str]]:
    """module -> the package's modules it imports (see the module docstring);
    ``at_import_only``: only the imports that run when the module is imported."""
    files = {module_name(p, root, package): p for p in sorted(root.rglob("*.py"))}
    known = set(files)
    graph: dict[str, set[str]] = {}
    for name, path in files.items():
        edges: set[str] = set()
        for module, names, _ in imports(path.read_text(), name, path.name == "__init__.py",
                                        top_level_only=at_import_only,
                                        runnable_only=not at_import_only):
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


def cycles_in(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every cycle found by removing one edge of each cycle until none is left: the
    number of imports that must go for the graph to be acyclic (an upper bound)."""
    graph = {k: set(v) for k, v in graph.items()}
    found = []
    while (cycle := cycle_in(graph)) is not None:
        found.append(cycle)
        # graphlib reports a cycle in reverse: cycle[i + 1] imports cycle[i]
        a, b = cycle[1], cycle[0]
        graph[a].discard(b) if b in graph[a] else graph[b].discard(a)
    return found


def floor_of(module: str, layers: tuple[tuple[str, ...], ...] = LAYERS) -> int | None:
    """The index in ``layers`` (0: top) of the longest entry that is ``module`` or
    a package above it; None when no entry covers it. The root package's entry is
    its ``__init__`` alone: a new module at the root must be given a floor."""
    best, best_len = None, -1
    for index, entry in enumerate(layers):
        for name in entry:
            covers = module == name or ("." in name and module.startswith(name + "."))
            if covers and len(name) > best_len:
                best, best_len = index, len(name)
    return best


def back_arrows(graph: dict[str, set[str]], layers: tuple[tuple[str, ...], ...] = LAYERS
                ) -> list[str]:
    """``importer -> imported`` for every import of a floor above the importer's."""
    wrong = []
    for module, edges in sorted(graph.items()):
        mine = floor_of(module, layers)
        for target in sorted(edges):
            theirs = floor_of(target, layers)
            if mine is not None and theirs is not None and theirs < mine:
                wrong.append(f"{module} -> {target}")
    return wrong


def unplaced(graph: dict[str, set[str]], layers: tuple[tuple[str, ...], ...] = LAYERS
             ) -> list[str]:
    """Modules on no floor."""
    return sorted(m for m in graph if floor_of(m, layers) is None)


def sibling_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """For each package, a cycle among its direct sub-packages (each standing for all
    its modules), if any. The package's own top-level modules are not a sibling: they
    assemble the sub-packages."""
    packages = {m.rsplit(".", 1)[0] for m in graph} | set(graph)
    packages = {p for p in packages if any(m.startswith(p + ".") for m in graph)}
    found = []
    for parent in sorted(packages):
        children = {p for p in packages if p.rsplit(".", 1)[0] == parent and p != parent}
        if len(children) < 2:
            continue

        def child(module: str, children: set[str] = children) -> str | None:
            return next((c for c in children if module == c or module.startswith(c + ".")),
                        None)

        sub: dict[str, set[str]] = {c: set() for c in children}
        for module, edges in graph.items():
            a = child(module)
            for target in edges:
                b = child(target)
                if a is not None and b is not None and a != b:
                    sub[a].add(b)
        if (cycle := cycle_in(sub)) is not None:
            found.append(cycle)
    return found


def house(root: Path, package: str = "kvrunner") -> dict[str, int]:
    """The figures: rooms (packages), modules at the root, floors, circles (cycles to
    break), back arrows, sibling cycles."""
    graph = import_graph(root, package)
    rooms = sum(1 for _ in root.rglob("__init__.py"))
    return {
        "rooms": rooms,
        "root_modules": sum(1 for p in root.glob("*.py") if p.name != "__init__.py"),
        "floors": len(LAYERS),
        "circles": len(cycles_in(graph)),
        "back_arrows": len(back_arrows(graph)),
        "sibling_cycles": len(sibling_cycles(graph)),
        "unplaced": len(unplaced(graph)),
    }


if __name__ == "__main__":
    core = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(__file__).resolve().parents[2] / "core"
    for key, value in house(core).items():
        print(f"{key:15} {value}")
    graph = import_graph(core, "kvrunner")
    for cycle in cycles_in(graph):
        print("circle:", " -> ".join(cycle))
    for arrow in back_arrows(graph):
        print("back arrow:", arrow)
