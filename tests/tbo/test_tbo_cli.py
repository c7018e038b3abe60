"""The command line knows an overlap plugin for what it is."""

from __future__ import annotations

from kvrunner.cli.main import main


def test_backends_lists_tbo_as_an_overlap_plugin(capsys) -> None:
    assert main(["backends"]) == 0
    (line,) = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("tbo ")]
    assert "(overlap plugin: backends.overlap)" in line


def test_check_backend_on_an_overlap_plugin_checks_it_over_every_layer_backend(capsys) -> None:
    assert main(["check-backend", "tbo", "--examples", "1", "--check",
                 "step_matches_reference"]) == 0
    out = capsys.readouterr().out
    assert "tbo is an overlap plugin: checking it on top of" in out
    assert "paged+tbo: all checks passed" in out and "gdn+tbo: all checks passed" in out
