"""docs/benchmarks.md has one section per benchmark script, and what it tells a reader
to run is there to run.

Each ``bench_*.py`` and ``profile_*.py`` of ``benchmarks/`` has its own ``## `name.py` ``
heading, and no heading names a script that is gone; each section gives its script's
command; every option a command or a section names is one its script reads; and every
repository path the page names exists. The checks read the scripts' source (a script
needs a GPU to import, and the fast tier has none).
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PAGE = ROOT / "docs" / "benchmarks.md"
BENCHMARKS = ROOT / "benchmarks"
HEADING = re.compile(r"^## `(?P<script>[a-z0-9_]+\.py)`$", re.M)
COMMAND = re.compile(r"`python (?P<path>[\w/.-]+\.py)(?P<args>[^`]*)`")
OPTION = re.compile(r"(?<![\w-])--(?P<name>[a-z][a-z0-9-]*)")
PATH = re.compile(r"`(?P<path>[\w.-]+(?:/[\w.-]+)+\.(?:py|sh|md|toml))`")


def scripts() -> set[str]:
    """The benchmark scripts: every ``bench_*.py`` and ``profile_*.py``."""
    return {p.name for pattern in ("bench_*.py", "profile_*.py") for p in BENCHMARKS.glob(pattern)}


def sections() -> dict[str, str]:
    """Each script heading's name and the text of its section."""
    text = PAGE.read_text()
    found: dict[str, str] = {}
    for match in HEADING.finditer(text):
        end = text.find("\n## ", match.end())
        found[match["script"]] = text[match.end() : end if end >= 0 else len(text)]
    return found


def reads_option(source: str, name: str) -> bool:
    """Whether a script's source spells option ``--name``: whole, or quoted as the name
    (or the field, ``name_with_underscores``) a loop of ``add_argument(f"--{...}")`` builds
    it from."""
    if re.search(rf"--{re.escape(name)}(?![\w-])", source):
        return True
    quoted = {f'"{name}"', f'"{name.replace("-", "_")}"'}
    return 'add_argument(f"--{' in source and any(q in source for q in quoted)


def test_every_benchmark_script_has_one_section_and_every_section_a_script() -> None:
    named = [m["script"] for m in HEADING.finditer(PAGE.read_text())]
    repeated = sorted({n for n in named if named.count(n) > 1})
    assert not repeated, f"scripts with more than one section: {repeated}"
    missing, gone = scripts() - set(named), set(named) - scripts()
    assert not missing, f"benchmark scripts without a section in {PAGE.name}: {sorted(missing)}"
    assert not gone, f"sections for scripts benchmarks/ no longer holds: {sorted(gone)}"


def test_each_section_gives_its_scripts_command() -> None:
    lacking = [
        name
        for name, text in sections().items()
        if not any(m["path"] == f"benchmarks/{name}" for m in COMMAND.finditer(text))
    ]
    assert not lacking, f"sections without `python benchmarks/<script>` for their script: {lacking}"


def test_every_option_the_page_names_is_one_its_script_reads() -> None:
    unread: list[str] = []
    for name, text in sections().items():
        if name not in scripts():
            continue  # a section for a missing script fails the first test
        source = (BENCHMARKS / name).read_text()
        for option in {m["name"] for m in OPTION.finditer(text)}:
            if not reads_option(source, option):
                unread.append(f"{name}: --{option}")
    for match in COMMAND.finditer(PAGE.read_text()):
        script = ROOT / match["path"]
        assert script.is_file(), f"a command runs {match['path']}, which does not exist"
        source = script.read_text()
        for option in OPTION.finditer(match["args"]):
            if not reads_option(source, option["name"]):
                unread.append(f"{match['path']}: --{option['name']}")
    assert not unread, f"options the page names that no script reads: {sorted(set(unread))}"


def test_every_repository_path_the_page_names_exists() -> None:
    paths = {m["path"] for m in PATH.finditer(PAGE.read_text())}
    assert paths, f"no repository paths found in {PAGE.name}"
    missing = sorted(p for p in paths if not (ROOT / p).exists())
    assert not missing, f"paths in {PAGE.name} that do not exist: {missing}"
