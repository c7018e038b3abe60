"""The runtime audit (``LLM(..., audit=True)``, ``generate --audit``) catches what the
kit catches, at the first capture, and its message says what the evidence shows.

Each defect is one of the kit's mutant backends, driven through the real engine.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

import pytest
from mutants import AUDIT_MUTANTS, UndeclaredMirrors

from kvrunner import LLM, SamplingParams
from kvrunner.cli.main import main
from kvrunner.plugin_api import BackendError
from kvrunner.plugin_host.plugins import register_backend, unregister_backend
from kvrunner.runner.capture.capture_safety import CaptureAuditError

PROMPTS = [[5, 6, 7, 8, 9], [10, 11, 12], [13, 14, 15, 16, 17, 18, 19]]
GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)

@contextmanager
def mutant(name: str) -> Iterator[str]:
    register_backend(name, AUDIT_MUTANTS[name][0])
    try:
        yield name
    finally:
        unregister_backend(name)


def audited_start_failure(start: Callable[..., LLM], name: str) -> str:
    """The message of the audit failure that starting over mutant ``name`` raises."""
    with mutant(name), pytest.raises(CaptureAuditError) as raised:
        start(name, audit=True)
    return str(raised.value)


def greedy_tokens(llm: LLM) -> list[list[int]]:
    return [o.token_ids for o in llm.generate(PROMPTS, GREEDY)]


def test_a_write_target_kept_on_the_builder_is_caught_at_the_first_capture(start) -> None:
    name = "mutant-builder-held-target"
    message = audited_start_failure(start, name)
    assert message.startswith(f"backend {name!r}:")
    assert f"Undeclared target: the writes follow ['{name}.builder.slot_mapping']" in message
    assert "Writes at PAD" not in message


def test_a_write_target_three_levels_down_is_caught_at_the_first_capture(start) -> None:
    name = "mutant-deep-held-target"
    message = audited_start_failure(start, name)
    assert f"Undeclared target: the writes follow ['{name}.state.parts.builder.slot_mapping']" \
        in message


def test_a_wrong_pad_value_is_named_as_such_not_as_writes_at_pad(start) -> None:
    name = "mutant-wrong-pad-value"
    message = audited_start_failure(start, name)
    assert message.startswith(f"backend {name!r}:")
    assert f"Wrong PAD value: blanked with their declared PAD values the targets " \
           f"{name}.slot_mapping (pad_value=0)" in message
    assert "Writes at PAD" not in message


def test_undeclared_overlap_mirrors_are_blamed_on_the_overlap_plugin(start) -> None:
    name = "mutant-undeclared-mirrors"
    register_backend(name, UndeclaredMirrors)
    try:
        with pytest.raises(CaptureAuditError) as raised:
            start("paged", overlap=name, overlap_min_tokens=2, overlap_min_decode_seqs=2,
                  audit=True)
    finally:
        unregister_backend(name)
    message = str(raised.value)
    assert message.startswith(f"overlap plugin {name!r}: capture of batch size")
    assert f"the writes follow ['{name}.part0.paged.slot_mapping'" in message


def test_a_capture_read_side_at_live_blocks_gives_wrong_tokens_unaudited(start) -> None:
    """What the audit exists to stop: the mutant's greedy tokens are not paged's."""
    with mutant("mutant-capture-reads-live-blocks") as name:
        llm = start(name)
        llm.generate(PROMPTS, GREEDY)  # live blocks on its builder, then a recapture
        llm.recapture()
        wrong = greedy_tokens(llm)
    assert wrong != greedy_tokens(start("paged"))


def test_a_capture_read_side_at_live_blocks_is_caught_at_the_first_capture(start) -> None:
    name = "mutant-capture-reads-live-blocks"
    message = audited_start_failure(start, name)
    assert message.startswith(f"backend {name!r}:")
    assert f"metadata.{name}.block_tables" in message and "reads live blocks" in message


def test_a_kernel_that_ignores_pad_is_reported_as_writing_at_pad(start) -> None:
    name = "mutant-stores-pad-rows"
    message = audited_start_failure(start, name)
    assert message.startswith(f"backend {name!r}:") and "Writes at PAD" in message
    assert "Undeclared target" not in message


def test_the_audited_engine_still_matches_the_unaudited_one(start) -> None:
    """The seeding and the read-side rebuild leave a correct backend's tokens as they are."""
    audited = start("paged", audit=True)
    first = greedy_tokens(audited)
    audited.recapture()
    assert greedy_tokens(audited) == first == greedy_tokens(start("paged"))


def test_an_audit_failure_is_a_backend_error_printed_as_one_line(tiny_qwen3, capsys) -> None:
    with mutant("mutant-builder-held-target") as name:
        status = main(["generate", "hi", "--model", tiny_qwen3, "--max-tokens", "2",
                       "--max-num-seqs", "2", "--max-model-len", "64", "--audit",
                       "--full-attention", name])
    err = capsys.readouterr().err
    assert status == 2 and issubclass(CaptureAuditError, BackendError)
    assert "Traceback" not in err
    (line,) = [ln for ln in err.splitlines() if ln.startswith("kvrunner: error:")]
    assert line.startswith(f"kvrunner: error: backend {name!r}:")
