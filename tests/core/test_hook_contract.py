"""Every hook is documented in code and in docs/plugins.md, and has a test."""

from __future__ import annotations

import inspect
from pathlib import Path

import pytest

from kvrunner.plugin_api import hookspecs

ROOT = Path(__file__).resolve().parents[2]
HOOKS = sorted(
    name
    for name, fn in vars(hookspecs).items()
    if inspect.isfunction(fn) and hasattr(fn, "kvrunner_spec")
)
TEST_SOURCES = [
    p.read_text() for p in (ROOT / "tests").rglob("test_*.py") if p.name != Path(__file__).name
]


def test_the_mission_hooks_exist() -> None:
    assert {"build_capture_metadata", "cache_write_targets"} <= set(HOOKS)
    assert len(HOOKS) >= 8


@pytest.mark.parametrize("hook", HOOKS)
def test_hook_has_a_docstring(hook: str) -> None:
    assert (inspect.getdoc(getattr(hookspecs, hook)) or "").strip()


@pytest.mark.parametrize("hook", HOOKS)
def test_hook_has_a_section_in_the_plugin_docs(hook: str) -> None:
    assert f"### `{hook}`" in (ROOT / "docs" / "plugins.md").read_text()


@pytest.mark.parametrize("hook", HOOKS)
def test_hook_is_exercised_by_a_test(hook: str) -> None:
    assert any(hook in src for src in TEST_SOURCES), f"no test mentions hook {hook}"
