"""Shared test set-up: hypothesis profiles, the ``gpu`` and ``slow`` markers, the Triton
interpreter, and test backends installed as real packages.

The fast tier is ``-m "not gpu and not slow"`` (a few minutes on two cores): every
test but those :data:`SLOW` names. CI runs both tiers (``-m "not gpu"``).

Profiles: ``ci`` (default, few examples, keeps CI fast) and ``thorough`` (many
examples): ``HYPOTHESIS_PROFILE=thorough pytest``.
"""

from __future__ import annotations

import importlib
import os
import signal
import subprocess
import sys
from pathlib import Path

# Without CUDA, Triton kernels run under the interpreter; this must be set before
# triton is first imported anywhere.
try:
    import torch

    _HAS_CUDA = torch.cuda.is_available()
except ImportError:  # pragma: no cover
    _HAS_CUDA = False
if not _HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")
    # Two cores: torch's intra-op threads only contend on the tiny shapes tests use.
    torch.set_num_threads(1)

import pytest  # noqa: E402
from hypothesis import HealthCheck, settings  # noqa: E402

# A shell without job control starts a background command with SIGINT ignored, and a
# Python started that way keeps it ignored, as do the subprocesses it starts: the Ctrl-C
# tests (KeyboardInterrupt in this process, exit 130 from the CLI) would then test
# nothing. Python's own handler, as in a terminal, whatever launched the suite.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)

settings.register_profile(
    "ci", max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
settings.register_profile(
    "thorough", max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))

ROOT = Path(__file__).resolve().parents[1]
FIXTURES = ROOT / "tests" / "fixtures"


def pip_install_into(site: Path, package: Path) -> None:
    """``pip install --target site package`` (no dependencies, no build isolation)."""
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation",
         "--target", str(site), str(package)],
        check=True,
    )


def _installed(tmp_path_factory: pytest.TempPathFactory, package: Path):
    """``package`` pip-installed into a private site dir, on ``sys.path`` meanwhile."""
    site = tmp_path_factory.mktemp("site")
    pip_install_into(site, package)
    sys.path.insert(0, str(site))
    importlib.invalidate_caches()
    yield str(site)
    sys.path.remove(str(site))
    importlib.invalidate_caches()


@pytest.fixture(scope="session")
def flatkv_installed(tmp_path_factory: pytest.TempPathFactory) -> str:
    """tests/fixtures/flatkv_backend (backends ``flatkv`` and ``leaky``), installed."""
    yield from _installed(tmp_path_factory, FIXTURES / "flatkv_backend")


@pytest.fixture(scope="session")
def minimal_installed(tmp_path_factory: pytest.TempPathFactory) -> str:
    """examples/minimal_backend (backend ``minimal``, the docs' tutorial), installed."""
    yield from _installed(tmp_path_factory, ROOT / "examples" / "minimal_backend")


#: The slow tier: node-id prefixes (relative to tests/) of the tests that take seconds
#: each on two cores, by why. Each has a faster sibling in the fast tier that holds
#: the same invariant at a smaller size, or is one of the whole-system runs below.
SLOW: dict[str, tuple[str, ...]] = {
    # random orders of many calls (the 50-cycle runs of test_sleep_wake.py are marked
    # where they are parametrized; the fast tier runs 3 cycles of each level)
    "long cycles": ("core/test_sleep_wake_state_machine.py",),
    # several processes: spawned ranks, torchrun, a Ray cluster, signals
    "TP, torchrun, Ray": (
        "core/distributed/test_sleep_wake_tp.py", "core/distributed/test_tensor_parallel.py",
        "core/distributed/test_heartbeat.py", "core/distributed/test_supervisor_interrupts.py",
        "core/async/test_async_llm_tp.py", "core/test_interrupted_generate.py",
        "core/test_moe_generate.py::test_two_ranks", "tbo/test_tbo_generate.py::test_two_ranks",
        "core/test_routed_experts.py::test_two_ranks",
        "serve/test_shutdown.py::test_tp2", "core/test_cli_usability.py::test_ctrl_c", "ray/",
        "serve/test_dead_engine.py",
    ),
    # whole engines on the Triton interpreter, and the kernels' interpreted sweeps
    "interpreted kernels": (
        "conformance/test_backends.py::test_triton_path",
        "conformance/test_backends.py::test_with_tbo_on_top_of_the_triton_path",
        "core/test_graph_sampling.py::test_an_engine_with_graphs_draws_what_an_eager_one_draws",
        "core/models/test_logprobs_mode_generate.py::test_graphs_report",
        "core/models/test_logprobs_mode_generate.py::test_an_eager_engine_reports_what_an_engine",
        "core/models/test_logprobs_mode_generate.py::test_the_mode_leaves_the_tokens_alone",
        "core/test_graph_sampling.py::test_unseeded_draws_are_drawn_in_the_graph",
        "paged/test_fixed_order_attention.py::test_an_engine_on_the_triton_path",
        "core/aligned/test_aligned_triton_path.py",
        "paged/test_paged_decode_attention.py::test_every_split",
        "core/layers/test_seeded_uniform.py::test_seeded_draws_follow_the_filtered_distribution",
        "core/layers/test_skinny_gemm.py::test_a_model_decodes_the_same_greedy_tokens",
        "core/layers/test_skinny_swiglu.py::test_a_single_sequence_decodes_the_same_greedy",
        "gdn/test_gdn_conv.py::test_every_tile_of_the_triton_conv_prefill",
        "gdn/test_gdn_prefill.py::test_prefill_matches_token_loop",
        "gdn/test_gdn_prefill.py::test_prefill_lengths_off_the_chunk_grid",
    ),
    # the kit against every planted defect and the engine-level batch-invariance
    # probes; the fast tier keeps the kit's audit mutant and the torch-path checks
    "whole-kit runs": (
        "conformance/test_mutants.py::test_the_kit_catches_each_defect_the_runtime_audit",
        "conformance/test_mutants.py::test_the_check_fails_on_its_mutant",
        "conformance/test_batch_invariance_check.py::test_paged_keeps_it_with_tbo",
        "core/determinism/test_batch_invariance.py",
        "tbo/test_tbo_generate.py::test_without_blanking_the_mirrors",
        "conformance/test_runtime_audit.py::test_an_audit_failure_is_a_backend_error_printed",
        "tbo/test_tbo_generate.py::test_an_undeclared_mirror_is_caught_by_the_audit",
        "conformance/test_step_audit.py::test_the_kit_catches_each_step_defect_too",
        "conformance/test_batch_invariance_check.py::test_a_linear_attention_backend_that_claims",
        "conformance/test_batch_invariance_check.py::test_paged_keeps_its_batch_invariance",
        # the step audit's schedules over the hybrid and overlap stacks (paged alone stays)
        "core/test_step_audit_schedules.py::test_no_step_of_any_schedule_raises_a_false_alarm[g",
        "core/test_step_audit_schedules.py::test_no_step_of_any_schedule_raises_a_false_alarm[paged+",
        "tbo/test_tbo_generate.py::test_a_capture_after_serving_writes_nothing_through",
        "weight_sync/test_direct_push.py::test_a_trainer_killed_mid_direct_push",
    ),
    # end-to-end jobs: transformers parity at batch, load, the GRPO example, the CLI job
    "end-to-end jobs": (
        "core/test_moe_generate.py::test_batched_greedy_matches_transformers",
        "serve/test_load.py", "examples/test_grpo_example.py",
        # a second scripted server (the hermes one and the parsers' own tests stay fast)
        "serve/test_chat_parsers_live.py::test_qwen3_coder",
        "serve/test_stale_reuse_wire.py",
        "core/test_without_triton.py::test_rollout_of_the_hybrid",
        "core/test_rollout.py::test_perturbed_rounds_alternate",
        "core/test_rollout.py::test_every_round_repeats_round_1",
        "core/test_rollout.py::test_token_id_prompts_roll_out",
        "weight_sync/test_direct_push.py::test_closing_the_sender_unmaps",
        "weight_sync/test_direct_push.py::test_a_malformed_direct_message",
        "weight_sync/test_peer_trainers.py::test_trls_weight_transfer_calls_land_as_one_update_each[init-",
        "weight_sync/test_group_on_shutdown.py",
    ),
}


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    prefixes = tuple(p for group in SLOW.values() for p in group)
    tests = ROOT / "tests"
    for item in items:
        node = item.nodeid
        path = item.path
        if path.is_relative_to(tests):
            node = str(path.relative_to(tests)) + node[len(node.split("::")[0]):]
        if node.startswith(prefixes):
            item.add_marker(pytest.mark.slow)
    if _HAS_CUDA:
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _kernel_choices_restored():
    """Every runner installs its config's ``[kernels]`` in its process (the layers ask the
    process); each test starts from the choices before it, whatever engine it built."""
    from kvrunner.layers.fused import dispatch

    before = dispatch.chosen_kernels()
    yield
    dispatch.choose_kernels(before)
