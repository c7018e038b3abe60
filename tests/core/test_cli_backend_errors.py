"""On the command line a backend's bug keeps its traceback; a configuration error does not."""

from __future__ import annotations

import pytest

from kvrunner import plugin_api
from kvrunner.cli.main import main
from kvrunner.plugin_host.plugins import register_backend, unregister_backend
from kvrunner_paged import PagedBackend

ARGS = ["generate", "hi", "--model", "tiny-qwen3", "--max-tokens", "2", "--enforce-eager",
        "--max-num-seqs", "2", "--max-model-len", "64"]


class SizingBug(PagedBackend):
    @plugin_api.hookimpl
    def cache_spec(self):
        raise ZeroDivisionError("bytes per block")


@pytest.fixture
def buggy():
    register_backend("sizing-bug", SizingBug)
    yield
    unregister_backend("sizing-bug")


def test_a_hook_that_raises_is_printed_with_its_traceback(buggy, kvrunner_home, capsys) -> None:
    assert main([*ARGS, "--full-attention", "sizing-bug"]) == 2
    err = capsys.readouterr().err
    assert "Traceback" in err and "ZeroDivisionError" in err
    assert "kvrunner: error: backend 'sizing-bug': hook cache_spec failed" in err


def test_an_unknown_backend_is_one_line_and_traceback_adds_it(kvrunner_home, capsys) -> None:
    assert main([*ARGS, "--full-attention", "nope"]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and "'nope'" in err and "not installed" in err
    assert main([*ARGS, "--full-attention", "nope", "--traceback"]) == 2
    assert "Traceback" in capsys.readouterr().err
