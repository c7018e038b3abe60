"""What a Python file imports, read from its syntax tree without importing it.

Shared by the structural tests: which kvrunner modules a backend's files reach, and
the import graph of kvrunner's own modules.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path


def module_name(path: Path, package_root: Path, package: str) -> str:
    """``core/runner/capture/capture.py`` -> ``kvrunner.runner.capture.capture``; a package's
    ``__init__.py`` is the package itself."""
    parts = list(path.relative_to(package_root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join([package, *parts])


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _executed(body: list[ast.stmt], *, into_functions: bool) -> Iterator[ast.stmt]:
    """The statements of ``body`` that can run: into ``if`` (not ``if TYPE_CHECKING``,
    which never runs), ``try``, ``with``, loops and class bodies, and into functions
    when ``into_functions`` (their imports run when they are called, not when the
    module is imported)."""
    for node in body:
        yield node
        if isinstance(node, ast.If):
            if not _is_type_checking(node.test):
                yield from _executed(node.body, into_functions=into_functions)
            yield from _executed(node.orelse, into_functions=into_functions)
        elif isinstance(node, ast.Try):
            for block in (node.body, node.orelse, node.finalbody):
                yield from _executed(block, into_functions=into_functions)
            for handler in node.handlers:
                yield from _executed(handler.body, into_functions=into_functions)
        elif isinstance(node, (ast.With, ast.ClassDef, ast.For, ast.While)) or (
                into_functions and isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))):
            yield from _executed(node.body, into_functions=into_functions)


def imports(source: str, this_module: str, is_package: bool, *, top_level_only: bool,
            runnable_only: bool = False) -> Iterator[tuple[str, tuple[str, ...], int]]:
    """``(module, names, line)`` per import statement: ``names`` is empty for
    ``import a.b``, else the names of ``from a.b import x, y``. Relative imports are
    resolved against ``this_module``. ``top_level_only``: those that run when the
    module is imported; ``runnable_only``: those that can ever run (functions'
    included, ``if TYPE_CHECKING`` blocks not); neither: every import statement."""
    tree = ast.parse(source)
    if top_level_only or runnable_only:
        nodes = _executed(tree.body, into_functions=not top_level_only)
    else:
        nodes = ast.walk(tree)
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
