"""The kit checks a backend's ``batch_invariant`` claim through the whole engine.

``probe_bits_match_alone`` holds a backend that declares ``batch_invariant = True``
to its promise: a probe request's tokens and logprobs on ``deterministic=True``
engines over the tiny model are the bits it gets alone, in random mixes of other
requests. ``paged`` keeps it, alone and under ``tbo``; ``gdn`` claiming it is caught
(and test_mutants.py catches a backend whose exact attention splits its keys by the
step's sequence count).
"""

from __future__ import annotations

import pytest
from mutants import GDNClaimsInvariance

from kvrunner.cli.main import main
from kvrunner.plugin_host.plugins import register_backend, unregister_backend
from kvrunner.sampling_params import SamplingParams
from kvrunner.testing.conformance import ConformanceError, Target, run_check
from kvrunner.testing.conformance.batch_invariance import probe_bits_match_alone
from kvrunner.testing.conformance.probes import Mixed, ProbeCase

CHECK = "probe_bits_match_alone"


@pytest.fixture
def registered():
    """``registered(name, factory)``: an in-process backend, unregistered afterwards."""
    names = []

    def register(name: str, factory: type) -> str:
        register_backend(name, factory)
        names.append(name)
        return name

    yield register
    for name in names:
        unregister_backend(name)


def test_paged_keeps_its_batch_invariance_promise() -> None:
    (target,) = Target.of("paged")
    assert target.batch_invariant
    assert 1 <= run_check(target, CHECK, max_examples=6) <= 6


def test_paged_keeps_it_with_tbo_cutting_every_step() -> None:
    (target,) = Target.of("paged", overlap="tbo")
    assert 1 <= run_check(target, CHECK, max_examples=3) <= 3


def test_a_crowded_small_pool_mix_preempts_and_hits_the_prefix_cache() -> None:
    """The kinds of mix the strategy draws do what they are for: a small pool preempts
    and a warmed or shared prefix hits, and the probe's bits survive both."""
    probe = list(range(1, 20))
    case = ProbeCase(
        probe=probe,
        params=SamplingParams(max_tokens=8, temperature=0.9, seed=3, logprobs=2,
                              prompt_logprobs=0, ignore_eos=True),
        others=[([*probe[:8], 7, 8, 9], SamplingParams(max_tokens=3, ignore_eos=True))]
        + [([11 + i] * 24, SamplingParams(max_tokens=40, ignore_eos=True)) for i in range(3)],
        position=2, mixed=Mixed(budget=5, small_pool=True, async_scheduling=True,
                                enforce_eager=False),
        warm_prefix=True, sleep_first=True,
    )  # fmt: skip
    (target,) = Target.of("paged")
    seen = probe_bits_match_alone(target, case)
    assert seen.preemptions > 0 and seen.prefix_hit_tokens > 0


def test_a_linear_attention_backend_that_claims_it_falsely_is_caught(registered) -> None:
    """``gdn``'s chunked prefill and recurrent decode sum in different orders: declared
    batch-invariant, it is caught (the probe runs on the hybrid tiny model)."""
    (target,) = Target.of(registered("mutant-gdn-claims-invariance", GDNClaimsInvariance))
    assert target.layer_type == "linear_attention"
    with pytest.raises(ConformanceError, match="mutant-gdn-claims-invariance"):
        run_check(target, CHECK, max_examples=12)


def test_a_backend_that_does_not_claim_it_is_not_held_to_it(capsys) -> None:
    (target,) = Target.of("gdn")
    with pytest.raises(ValueError, match=r"batch_invariant promise, which 'gdn' does not make"):
        run_check(target, CHECK)
    assert main(["check-backend", "gdn", "--check", CHECK]) == 0
    out = capsys.readouterr().out
    assert f"skip gdn linear_attention {CHECK} (" in out and "batch_invariant is False" in out


@pytest.mark.gpu
def test_paged_keeps_it_on_the_cuda_path() -> None:
    (target,) = Target.of("paged", use_triton=True, device="cuda")
    assert 1 <= run_check(target, CHECK, max_examples=12) <= 12
