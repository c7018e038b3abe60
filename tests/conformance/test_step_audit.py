"""The step audit (``audit=True``) names a backend at the step that broke the step
contract: it wrote a pool row the step was not given, wrote a buffer the core owns,
or replaced a write target; and the core refuses, at load or at the first audited
step, a ``cache_spec`` that understates its pools and a ``cache_rows`` that copies.

Every defect is a mutant of ``paged`` driven through the real engine; each is shown
silent (wrong tokens, or nothing said) without the audit.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import pytest
from mutants import (
    STEP_MUTANTS,
    CopiedRows,
    ReplacesTarget,
    UnderstatedSpec,
    WritesPositions,
)

from kvrunner import LLM, SamplingParams
from kvrunner.plugin_api import BackendError
from kvrunner.plugin_host.plugins import register_backend, unregister_backend
from kvrunner.runner.step.step_audit import StepAuditError

#: three prompts: a decode step of three rows replays the graph of four, with a padded row
PROMPTS = [[5, 6, 7, 8, 9], [10, 11, 12], [13, 14, 15, 16, 17, 18, 19]]
GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


@contextmanager
def mutant(name: str, factory: type) -> Iterator[str]:
    register_backend(name, factory)
    try:
        yield name
    finally:
        unregister_backend(name)


def greedy_tokens(llm: LLM) -> list[list[int]]:
    return [o.token_ids for o in llm.generate(PROMPTS, GREEDY)]


@pytest.mark.parametrize("name", sorted(STEP_MUTANTS))
def test_a_step_that_writes_outside_its_slots_is_named_at_that_step(start, name: str) -> None:
    with mutant(name, STEP_MUTANTS[name]):
        llm = start(name, audit=True)  # the capture audit passes it
        with pytest.raises(StepAuditError) as raised:
            llm.generate(PROMPTS, GREEDY)
    message = str(raised.value)
    assert message.startswith(f"backend {name!r}: a step wrote layer ")
    assert "buffer 'kv." in message and "(block " in message
    assert "a step writes only the slots it was given" in message


@pytest.mark.parametrize("name", sorted(STEP_MUTANTS))
def test_each_of_those_defects_is_silent_and_wrong_without_the_audit(start, name: str) -> None:
    with mutant(name, STEP_MUTANTS[name]):
        wrong = greedy_tokens(start(name))
    assert wrong != greedy_tokens(start("paged"))


def test_a_backend_that_writes_the_cores_positions_is_named_with_its_hook(start) -> None:
    with mutant("mutant-writes-positions", WritesPositions) as name:
        assert greedy_tokens(start(name)) != greedy_tokens(start("paged"))  # silent, wrong
        llm = start(name, audit=True, enforce_eager=True)
        with pytest.raises(StepAuditError) as raised:
            llm.generate(PROMPTS, GREEDY)
    message = str(raised.value)
    assert message.startswith(f"backend {name!r}: backend {name!r}'s build_metadata wrote "
                              f"the core's step buffer(s) ['positions']")


def test_a_write_target_replaced_under_its_name_is_refused(start) -> None:
    with mutant("mutant-replaces-target", ReplacesTarget) as name:
        start(name).generate(PROMPTS, GREEDY)  # unaudited: nothing said
        llm = start(name, audit=True, enforce_eager=True)
        with pytest.raises(BackendError, match="write target 'slot_mapping' is a new tensor "
                                               "under an old name"):
            llm.generate(PROMPTS, GREEDY)


def test_a_cache_spec_that_understates_the_pools_is_refused_at_load(start) -> None:
    name = "mutant-understated-spec"
    with mutant(name, UnderstatedSpec), pytest.raises(BackendError) as raised:
        start(name)
    message = str(raised.value)
    assert message.startswith(f"backend {name!r}: allocate_cache(48 blocks")
    assert "but its cache_spec promised" in message


def test_a_cache_rows_that_copies_is_refused_at_the_first_audited_step(start) -> None:
    with mutant("mutant-copied-rows", CopiedRows) as name:
        llm = start(name, audit=True, enforce_eager=True)
        with pytest.raises(BackendError, match="is not a view of the pool"):
            llm.generate(PROMPTS, GREEDY)


def test_the_step_audit_checks_every_step_of_a_correct_backend_without_an_alarm(start) -> None:
    audited = start("paged", audit=True)
    assert greedy_tokens(audited) == greedy_tokens(start("paged"))
    steps = audited.runner.launcher.audit.steps
    assert steps >= GREEDY.max_tokens  # one prefill, then a decode step per token


class RaisesInBuildMetadata(WritesPositions):
    """A hook that raises: every check that builds a step fails on it."""

    def build_metadata(self, step):  # noqa: ANN001, ANN201
        raise IndexError("slot 9 is out of bounds")


def test_check_backend_reports_every_broken_rule_and_runs_the_rest(capsys) -> None:
    from kvrunner.cli.main import main
    from kvrunner.plugin_api import hookimpl

    RaisesInBuildMetadata.build_metadata = hookimpl(RaisesInBuildMetadata.build_metadata)
    checks = ["cache_spec_matches_allocation", "core_buffers_untouched", "step_matches_reference"]
    with mutant("mutant-raises", RaisesInBuildMetadata):
        status = main(["check-backend", "mutant-raises", "--examples", "1",
                       *[a for c in checks for a in ("--check", c)]])
    out = capsys.readouterr().out
    assert status == 1 and "Traceback" not in out
    assert "ok   mutant-raises full_attention cache_spec_matches_allocation" in out
    for check in checks[1:]:  # each a FAIL line naming the check, none stopping the run
        assert f"FAIL mutant-raises full_attention {check}\n" in out
    assert "IndexError" in out and "2 check(s) failed" in out


@pytest.mark.parametrize("name", sorted(STEP_MUTANTS))
def test_the_kit_catches_each_step_defect_too(name: str) -> None:
    from kvrunner.testing.conformance import ConformanceError, Target, run_check

    with mutant(name, STEP_MUTANTS[name]):
        (target,) = Target.of(name)
        check = "write_targets_pad_past_live_rows" if name == "mutant-no-tail-pad" \
            else "only_live_rows_change"
        with pytest.raises((ConformanceError, ExceptionGroup)):
            run_check(target, check, max_examples=25)
