"""The distribution ships every package of the core.

``pyproject.toml`` lists the packages under ``core/`` one by one (the directory is
installed as ``kvrunner``), so a new subpackage left off the list imports in an
editable checkout and is missing from a wheel. Each directory of ``core/`` that holds
an ``__init__.py`` must be listed, and every listed one must exist.
"""

from __future__ import annotations

import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_every_core_package_is_in_the_distribution_and_only_those() -> None:
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    listed = set(config["tool"]["setuptools"]["packages"])
    core = ROOT / "core"
    on_disk = {
        ".".join(("kvrunner", *init.parent.relative_to(core).parts))
        for init in core.rglob("__init__.py")
    }
    unlisted, absent = sorted(on_disk - listed), sorted(listed - on_disk)
    assert not unlisted, f"add to [tool.setuptools] packages: {unlisted}"
    assert not absent, f"listed but not in core/: {absent}"
