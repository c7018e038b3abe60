"""What a Python file imports, read from its syntax tree without importing it.

Shared by the structural tests: which kvrunner modules a backend's files reach, and
the import graph of kvrunner's own modules.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path


def module_name(path: Path, package_root: Path, package: str) -> str:
    """``core/runner/capture.py`` -> ``kvrunner.runner.capture``; a package's
    ``__init__.py`` is the package itself."""
    parts = list(path.relative_to(package_root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join([package, *parts])


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _executed_at_import(body: list[ast.stmt]) -> Iterator[ast.stmt]:
    """The statements of ``body`` that run when the module is imported: into ``if``
    (not ``if TYPE_CHECKING``), ``try``, ``with`` and class bodies; never into a
    function, whose imports run only when it is called."""
    for node in body:
        yield node
        if isinstance(node, ast.If):
            if not _is_type_checking(node.test):
                yield from _executed_at_import(node.body)
            yield from _executed_at_import(node.orelse)
        elif isinstance(node, ast.Try):
            for block in (node.body, node.orelse, node.finalbody):
                yield from _executed_at_import(block)
            for handler in node.handlers:
                yield from _executed_at_import(handler.body)
        elif isinstance(node, (ast.With, ast.ClassDef)):
            yield from _executed_at_import(node.body)


def imports(source: str, this_module: str, is_package: bool, *, top_level_only: bool
            ) -> Iterator[tuple[str, tuple[str, ...], int]]:
    """``(module, names, line)`` per import statement: ``names`` is empty for
    ``import a.b``, else the names of ``from a.b import x, y``. Relative imports are
    resolved against ``this_module``."""
    tree = ast.parse(source)
    nodes = _executed_at_import(tree.body) if top_level_only else ast.walk(tree)
    for node in nodes:
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, (), node.lineno
        elif isinstance(node, ast.ImportFrom):
            module = node.module or ""
            if node.level:
                base = this_module.split(".")
                base = base[: len(base) - node.level + (1 if is_package else 0)]
                module = ".".join(base + ([module] if module else []))
            yield module, tuple(a.name for a in node.names), node.lineno


def targets(module: str, names: tuple[str, ...], known: set[str]) -> set[str]:
    """The modules an import statement makes Python execute, among ``known``: for
    ``from pkg import sub`` the submodule ``pkg.sub``; for ``from mod import name``
    the module itself."""
    if not names:
        return {module} & known
    found = {f"{module}.{n}" for n in names} & known
    if len(found) < len(names) and module in known:
        found.add(module)  # some names are attributes of ``module``: it runs
    return found
