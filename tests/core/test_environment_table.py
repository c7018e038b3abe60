"""Every environment variable the code reads is in the one table that documents them.

Kernel and behaviour choices are config fields; an environment variable remains only
as an override for a tool, and each is listed in docs/configuration.md's table. A
name read anywhere in the code (the packages, benchmarks, examples and tests) but
missing there fails, and so does a row whose variable nothing reads any more.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TABLE = ROOT / "docs" / "configuration.md"
NAME = re.compile(r"\bKVRUNNER_[A-Z][A-Z0-9_]*")
CODE_DIRS = ("core", "backends", "benchmarks", "examples", "tests")
SUFFIXES = {".py", ".sh", ".toml"}


def names_in_code() -> dict[str, list[str]]:
    """Each ``KVRUNNER_*`` name and the files that spell it."""
    found: dict[str, list[str]] = {}
    for top in CODE_DIRS:
        for path in sorted((ROOT / top).rglob("*")):
            if path.suffix in SUFFIXES and path.is_file():
                for name in set(NAME.findall(path.read_text(errors="replace"))):
                    found.setdefault(name, []).append(str(path.relative_to(ROOT)))
    return found


def names_in_table() -> set[str]:
    """The variables of the table under "## Environment variables" (first column)."""
    section = TABLE.read_text().split("## Environment variables", 1)[1].split("\n## ", 1)[0]
    return {m.group(1) for m in re.finditer(r"^\| `(KVRUNNER_[A-Z0-9_]+)` \|", section, re.M)}


def test_every_variable_the_code_reads_is_in_the_table_and_only_those() -> None:
    code, table = names_in_code(), names_in_table()
    assert table, f"no table of variables found in {TABLE}"
    missing = {n: files for n, files in code.items() if n not in table}
    assert not missing, f"document these in {TABLE.name}'s table, or make them config: {missing}"
    assert table <= set(code), f"rows for variables nothing reads: {sorted(table - set(code))}"
