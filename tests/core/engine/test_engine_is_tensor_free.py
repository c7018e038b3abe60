"""The engine side never sees tensors: no module under kvrunner/engine imports torch."""

from __future__ import annotations

import ast
from pathlib import Path

import kvrunner.engine

ENGINE_DIR = Path(kvrunner.engine.__file__).parent


def imported_roots(path: Path) -> set[str]:
    roots = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            roots.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            roots.add(node.module.split(".")[0])
    return roots


def test_no_engine_module_imports_torch_or_triton() -> None:
    modules = sorted(ENGINE_DIR.glob("*.py"))
    assert {p.name for p in modules} >= {"scheduler.py", "block_manager.py", "block_pool.py"}
    offenders = {p.name: imported_roots(p) & {"torch", "triton"} for p in modules}
    assert {name: libs for name, libs in offenders.items() if libs} == {}
