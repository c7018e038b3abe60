"""Catching, before any rank is spawned, a script that spawned ranks would re-run.

Tensor parallelism starts one process per rank with the ``spawn`` method, which
imports the parent's main script again in every child. A script that builds its
``LLM`` at module level, outside ``if __name__ == "__main__":``, would make every
rank build another ``LLM`` and spawn ranks of its own; Python stops that child,
and all the parent would see is ranks that died without a word. So the driver
looks, before spawning, at where in the main script it was called from.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path
from types import FrameType, ModuleType

from kvrunner.config import ConfigError


def _is_main_test(test: ast.expr) -> bool:
    """``__name__ == "__main__"`` (either way round)."""
    if not (isinstance(test, ast.Compare) and len(test.ops) == 1
            and isinstance(test.ops[0], ast.Eq)):
        return False
    sides = [test.left, test.comparators[0]]
    has_name = any(isinstance(s, ast.Name) and s.id == "__name__" for s in sides)
    has_main = any(isinstance(s, ast.Constant) and s.value == "__main__" for s in sides)
    return has_name and has_main


def _guarded_lines(source: str) -> list[tuple[int, int]]:
    """Line ranges of every ``if __name__ == "__main__":`` body in ``source``."""
    ranges = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.If) and _is_main_test(node.test):
            ranges.append((node.body[0].lineno, node.body[-1].end_lineno or node.lineno))
    return ranges


def _main_module_frame(main: ModuleType) -> FrameType | None:
    frame = sys._getframe()
    while frame is not None:
        if frame.f_globals is main.__dict__ and frame.f_code.co_name == "<module>":
            return frame
        frame = frame.f_back
    return None


def unguarded_call_site() -> tuple[str, int] | None:
    """``(script, line)`` if the main script's top level, outside a ``__main__``
    guard, is on the call stack; None otherwise (or when it cannot be told)."""
    main = sys.modules.get("__main__")
    file = getattr(main, "__file__", None)
    if main is None or not file:
        return None  # an interactive session or ``python -c``: spawn re-runs nothing
    frame = _main_module_frame(main)
    if frame is None:
        return None
    try:
        ranges = _guarded_lines(Path(file).read_text(encoding="utf-8"))
    except (OSError, SyntaxError, UnicodeDecodeError):
        return None
    line = frame.f_lineno
    if any(lo <= line <= hi for lo, hi in ranges):
        return None
    return file, line


def check_main_guard(what: str) -> None:
    """Raise ConfigError if spawning processes now would re-run the caller's script.

    :param what: what is about to spawn (named in the message).
    """
    site = unguarded_call_site()
    if site is None:
        return
    file, line = site
    raise ConfigError(
        f"{what} starts one process per rank, and each re-imports your script {file}; "
        f'line {line} runs at import time, outside an `if __name__ == "__main__":` block, '
        f"so every rank would start ranks of its own. Move the code that creates the LLM "
        f'under `if __name__ == "__main__":`'
    )
