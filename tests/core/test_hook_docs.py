"""docs/plugins.md states each hook's rules in the words of the hook's docstring.

The docstrings in ``kvrunner.plugin_api.hookspecs`` are the single source; the docs'
hook sections are rendered from them (``python tests/core/hook_docs.py --write``).
"""

from __future__ import annotations

import pytest
from hook_docs import DOCS, hooks, rendered, section


def test_every_hook_section_is_its_docstring_rendered() -> None:
    text = DOCS.read_text()
    assert rendered(text) == text, "run: python tests/core/hook_docs.py --write"


def test_every_hook_spec_is_rendered() -> None:
    names = hooks()
    assert {"allocate_cache", "cache_write_targets", "build_capture_metadata",
            "plan_micro_batches"} <= set(names)
    assert all(f"### `{name}`" in DOCS.read_text() for name in names)


def test_an_edited_section_is_told_apart_from_its_docstring() -> None:
    text = DOCS.read_text()
    edited = text.replace(section("release_cache"),
                          section("release_cache").replace("agreed counts", "same counts"))
    assert edited != text and rendered(edited) == text


def test_a_hook_without_a_section_is_named() -> None:
    text = DOCS.read_text().replace("### `make_layer`", "### `a_layer`")
    with pytest.raises(LookupError, match="make_layer"):
        rendered(text)


def test_param_fields_and_roles_become_markdown() -> None:
    allocate = section("allocate_cache")
    assert "- `num_blocks`: KV blocks." in allocate and ":param" not in allocate
    assert "``" not in allocate and ":func:" not in allocate
