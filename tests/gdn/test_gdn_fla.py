"""The chunked prefill through flash-linear-attention (fla-core), and the choice of it.

On the CPU: which kernel a backend picks (fla only where it imports and serves the
layer; ``ours`` keeps ours), and the wrapper's own work (gather through read indices,
PAD rows, scatter through write indices) around a stand-in for fla. fla's kernels do
not run under the Triton interpreter (fla 0.6.0's state kernel calls ``.to()`` on a
loop counter, which the interpreter makes a Python int, and its autotuner needs a
device to time on), so fla itself is compared with our torch path on the GPU only.
"""

from __future__ import annotations

import sys

import pytest
import torch
from gdn_testkit import (
    DEVICE,
    Case,
    Heads,
    assert_untouched,
    cases,
    delta_inputs,
    heads,
    make_manager,
    oracle_in_fla_layout,
    poison_fresh_slots,
    qkvgb,
    rel_rms,
    same_bytes,
    seq_rows,
    unguarded,
)
from hypothesis import given, settings

from kvrunner import LLM, SamplingParams
from kvrunner.config import KernelsConfig
from kvrunner.models.tiny import write_tiny_checkpoint
from kvrunner.testing.host_reads import forbid_host_reads
from kvrunner_gdn.ops.gated_delta_rule.chunk_fla import (
    chunk_gated_delta_rule_fla,
    fla_chunk_indices,
    fla_chunk_kernel,
)
from kvrunner_gdn.ops.gated_delta_rule.chunk_torch import chunk_gated_delta_rule_torch
from kvrunner_gdn.ops.gated_delta_rule.naive import l2norm, naive_recurrent_gated_delta_rule
from kvrunner_gdn.prefill_choice import choose_prefill_kernel

#: a layer fla serves under ``auto``: Triton on CUDA, bf16, Qwen3-Next's head size
CUDA_BF16 = dict(use_triton=True, device=torch.device("cuda"), dtype=torch.bfloat16,
                 head_k_dim=128)
#: fla against our fp32-state torch path fed q/k rounded after their L2 norm as fla
#: rounds them: fla also rounds its per-chunk states to bf16 (and runs fp32 products
#: as TF32), so the bound is the bf16 output tolerance of test_gdn_decode, not the fp32
#: TOL; a wrong state or index is O(1).
FLA_TOL = 1e-2


def block_fla(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make every ``import fla...`` fail, as where fla-core is not installed."""
    for name in {"fla", *(n for n in sys.modules if n.startswith("fla."))}:
        monkeypatch.setitem(sys.modules, name, None)


# -- the choice -----------------------------------------------------------------------


def test_auto_takes_fla_where_it_imports_and_ours_where_it_does_not(monkeypatch):
    pytest.importorskip("fla.ops.gated_delta_rule")
    assert choose_prefill_kernel(mode="auto", **CUDA_BF16) == "fla"
    block_fla(monkeypatch)  # the same layer, fla gone: only the import changed
    assert choose_prefill_kernel(mode="auto", **CUDA_BF16) == "triton"


def test_without_fla_auto_serves_ours_and_a_forced_fla_says_why(monkeypatch):
    block_fla(monkeypatch)
    assert fla_chunk_kernel() is None
    assert choose_prefill_kernel(mode="auto", **CUDA_BF16) == "triton"
    with pytest.raises(ValueError, match="gdn_prefill = 'fla'.*does not import"):
        choose_prefill_kernel(mode="fla", **CUDA_BF16)


def test_the_mode_forces_ours_or_fla():
    pytest.importorskip("fla.ops.gated_delta_rule")
    for mode, expected in (("ours", "triton"), ("fla", "fla"), ("auto", "fla")):
        assert choose_prefill_kernel(mode=mode, **CUDA_BF16) == expected, mode
    with pytest.raises(ValueError, match="auto, ours, fla"):
        choose_prefill_kernel(mode="theirs", **CUDA_BF16)


def test_unset_means_auto_fla_where_it_serves_and_ours_elsewhere(monkeypatch):
    import kvrunner_gdn.prefill_choice as choice

    monkeypatch.setattr(choice, "fla_chunk_kernel", lambda: chunk_gated_delta_rule_stand_in)
    assert choose_prefill_kernel(**CUDA_BF16) == "fla"
    assert choose_prefill_kernel(**(CUDA_BF16 | {"dtype": torch.float32})) == "triton"
    assert choose_prefill_kernel(mode="ours", **CUDA_BF16) == "triton"


def chunk_gated_delta_rule_stand_in(*args, **kwargs):  # only its availability is asked
    raise AssertionError("choosing a kernel must not call it")


def test_auto_keeps_ours_for_float32_the_cpu_and_wide_heads():
    """Each layer differs from CUDA_BF16 in one way only; fla imports, so ours is chosen
    for that difference and not for a missing fla."""
    pytest.importorskip("fla.ops.gated_delta_rule")
    choose = lambda mode, **change: choose_prefill_kernel(mode=mode, **(CUDA_BF16 | change))
    assert choose("auto", dtype=torch.float32) == "triton"
    assert choose("fla", dtype=torch.float32) == "fla"  # TF32, but asked for
    assert choose("auto", head_k_dim=512) == "triton"
    assert choose("auto", device=torch.device("cpu"), use_triton=False) == "torch"
    assert choose("auto", device=torch.device("cpu")) == "triton"  # interpreted Triton
    for change in ({"head_k_dim": 512}, {"device": torch.device("cpu")}):
        with pytest.raises(ValueError, match="cannot serve"):
            choose("fla", **change)


@pytest.mark.skipif(DEVICE.type == "cuda", reason="checks the CPU's choice")
def test_the_backend_reports_its_choice_and_hands_it_to_every_layer():
    for mode, use_triton, expected in (("ours", True, "triton"), ("auto", True, "triton"),
                                       ("auto", False, "torch")):
        manager = make_manager(use_triton, kernels=KernelsConfig(gdn_prefill=mode))
        (backend,) = manager.pm.get_plugins()
        assert backend.prefill_kernel == expected
        manager.persistent_buffers(max_batch=4, max_tokens=128)
        manager.allocate_cache(num_blocks=8, num_slots=5)
        for index in backend.context.layers:
            layer = manager.make_layer(layer_index=index, layer_type="linear_attention")
            assert layer.prefill_kernel == expected
    # fla cannot serve a CPU layer: said at once
    with pytest.raises(Exception, match="cannot serve this layer"):
        make_manager(True, kernels=KernelsConfig(gdn_prefill="fla"))


@pytest.mark.skipif(DEVICE.type == "cuda", reason="checks the CPU's choice")
def test_the_engines_config_reaches_the_backend_it_builds():
    """``[kernels] gdn_prefill`` reaches the gdn backend an engine builds: forced fla on
    the CPU is refused at start, and ``ours`` is what the backend reports."""
    with pytest.raises(Exception, match="cannot serve this layer"):
        LLM("tiny-qwen3-next", device="cpu", enforce_eager=True, gdn_prefill="fla")
    with LLM("tiny-qwen3-next", device="cpu", enforce_eager=True, max_num_seqs=2,
             max_model_len=64, gdn_prefill="ours") as llm:
        assert llm.runner.backends.pm.get_plugin("gdn").context.options == {"prefill": "ours"}


# -- the wrapper around a stand-in ---------------------------------------------------------


def oracle_per_sequence(q, k, v, g, beta, pool, case, scale):
    """What the wrapper must produce around the stand-in: each running sequence through
    the same oracle call the stand-in makes, from its read slot's state (zeros when
    fresh), its final state in its write slot; PAD sequences' rows zero."""
    out, pool = torch.zeros_like(v), pool.clone()
    finals = {}
    for i, (r, w) in enumerate(zip(case.read, case.write, strict=True)):
        rows = seq_rows(case, i)
        if w < 0:
            continue
        start = pool[r] if r >= 0 else torch.zeros_like(pool[0])
        out[rows], finals[w] = naive_recurrent_gated_delta_rule(q[rows], k[rows], v[rows], g[rows],
                                                    beta[rows], start, scale, True)
    for w, final in finals.items():  # after every read: a slot read and written swaps
        pool[w] = final
    return out, pool


@pytest.mark.skipif(DEVICE.type == "cuda", reason="the stand-in runs on the CPU")
@given(case=cases(max_len=40), h=heads)
def test_the_wrapper_reads_and_writes_only_through_the_indices(case, h):
    """Bit for bit the oracle's answer per sequence: the stand-in is that oracle, so any
    difference is the wrapper's (a wrong row, slot, offset or layout), not rounding."""
    gen = torch.Generator().manual_seed(case.seed)
    pool = torch.randn(case.num_slots, h.hv, h.dk, h.dv, generator=gen)
    poison_fresh_slots(pool, case)  # a fresh slot's NaN must reach no output or state
    q, k, v, g, beta = qkvgb(h, sum(case.lens), gen)
    read, write = case.indices()
    expected, expected_pool = oracle_per_sequence(q, k, v, g, beta, pool, case, h.dk**-0.5)
    after = pool.clone()
    host = case.cu_seqlens.tolist()
    # Half the batches with the host copies of the indices, which plan the call around
    # fresh and PAD rows: the same result either way.
    host_indices = (case.read, case.write) if case.seed % 2 else None
    # Around the stand-in (which reads its offsets on the host, as fla need not), the
    # wrapper may read no tensor value on the host: on CUDA that is a wait for the device.
    with forbid_host_reads("chunk_gated_delta_rule_fla"):
        out = chunk_gated_delta_rule_fla(
            inputs=delta_inputs(q, k, v, g, beta, after, read, write, h.dk**-0.5,
                                cu_seqlens=case.cu_seqlens, chunk_size=16,
                                cu_seqlens_host=host, host_indices=host_indices),
            kernel=unguarded(oracle_in_fla_layout))
    for i in range(case.num_seqs):
        rows = seq_rows(case, i)
        if case.write[i] < 0:
            assert torch.count_nonzero(out[rows]) == 0, f"PAD sequence {i} produced output"
            continue
        assert same_bytes(out[rows], expected[rows]), f"sequence {i} output"
        assert same_bytes(after[case.write[i]], expected_pool[case.write[i]]), f"sequence {i} state"
    assert_untouched(pool, after, case)


@pytest.mark.skipif(DEVICE.type == "cuda", reason="the stand-in runs on the CPU")
@pytest.mark.parametrize("history", [False, True], ids=["fresh", "continued"])
def test_one_running_sequence_takes_fla_plain_call_and_one_state_write(history):
    """With the host indices, a step of one running sequence calls fla without offsets
    (its varlen call costs more host time), and with no initial state when the sequence
    is fresh; output and written state are the oracle's bit for bit, no other slot
    changes."""
    h = Heads(1, 2, 8, 8)
    gen = torch.Generator().manual_seed(5)
    q, k, v, g, beta = qkvgb(h, 21, gen)
    pool = torch.randn(4, h.hv, h.dk, h.dv, generator=gen)
    read_slot, write_slot = (2, 2) if history else (-1, 1)
    if not history:
        pool[write_slot] = float("nan")  # a fresh slot's stale bytes must not leak in
    cu = torch.tensor([0, 21], dtype=torch.int32)
    read, write = (torch.tensor([i], dtype=torch.int32) for i in (read_slot, write_slot))
    one = Case(lens=(21,), read=(read_slot,), write=(write_slot,), num_slots=4, seed=5)
    expected, expected_pool = oracle_per_sequence(q, k, v, g, beta, pool, one, h.dk**-0.5)
    calls = []

    def recorded(*args, **kwargs):
        calls.append(kwargs)
        return oracle_in_fla_layout(*args, **kwargs)

    after = pool.clone()
    with forbid_host_reads("chunk_gated_delta_rule_fla"):
        out = chunk_gated_delta_rule_fla(
            inputs=delta_inputs(q, k, v, g, beta, after, read, write, h.dk**-0.5, cu_seqlens=cu,
                                cu_seqlens_host=[0, 21],
                                host_indices=([read_slot], [write_slot])),
            kernel=unguarded(recorded))
    (call,) = calls
    assert call.get("cu_seqlens") is None and call.get("chunk_indices") is None
    assert (call["initial_state"] is None) == (not history)
    assert same_bytes(out, expected)
    assert same_bytes(after[write_slot], expected_pool[write_slot])
    for slot in set(range(4)) - {write_slot}:
        assert same_bytes(pool[slot], after[slot]), f"slot {slot} changed without a write"


def test_the_chunk_map_is_the_one_fla_would_build():
    index = pytest.importorskip("fla.ops.utils.index")
    for cu in ([0, 1], [0, 64, 65, 65, 300], [0, 17, 200, 201]):
        for chunk in (16, 32, 64):
            want = index.prepare_chunk_indices(torch.tensor(cu), chunk)
            assert torch.equal(fla_chunk_indices(cu, chunk, torch.device("cpu")), want)


@pytest.mark.skipif(DEVICE.type == "cuda", reason="the stand-in runs on the CPU")
def test_the_wrapper_with_only_pad_rows_writes_no_slot_and_outputs_zeros():
    """No row runs: the scatter's spare write goes to slot 0 with slot 0's own bytes
    (NaN here), and every output row -- one past the last sequence too -- is zero."""
    h = Heads(1, 2, 8, 8)
    gen = torch.Generator().manual_seed(4)
    q, k, v, g, beta = qkvgb(h, 7, gen)
    pool = torch.randn(3, h.hv, h.dk, h.dv, generator=gen)
    pool[0] = float("nan")
    after = pool.clone()
    cu = torch.tensor([0, 2, 6], dtype=torch.int32)
    pad = torch.tensor([-1, -1], dtype=torch.int32)
    with forbid_host_reads("chunk_gated_delta_rule_fla"):
        out = chunk_gated_delta_rule_fla(
            inputs=delta_inputs(q, k, v, g, beta, after, torch.tensor([1, -1], dtype=torch.int32),
                                pad, h.dk**-0.5, cu_seqlens=cu),
            kernel=unguarded(oracle_in_fla_layout))
    assert torch.count_nonzero(out) == 0
    assert same_bytes(pool, after)


# -- fla itself, on the GPU ------------------------------------------------------------------


@pytest.fixture(scope="module")
def fla_kernel():
    """fla's forward as the layer binds it: called directly where that binds (it is the
    public call bit for bit, test_gdn_fla_forward.py), else ``chunk_gated_delta_rule``
    (module scope: hypothesis reruns the test)."""
    pytest.importorskip("fla.ops.gated_delta_rule")
    return fla_chunk_kernel()


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("h", [Heads(1, 2, 16, 16), Heads(2, 4, 128, 128)],
                         ids=["k16", "qwen3-next-heads"])
@settings(max_examples=8)
@given(case=cases(max_len=150))
def test_fla_equals_the_torch_path_on_varlen_batches_with_history(fla_kernel, case, h, dtype):
    """Random batches (fresh, continuing, forked and PAD rows; lengths across fla's
    64-token chunks) from nonzero states: outputs and written states as our torch path's,
    every other slot byte-identical."""
    gen = torch.Generator().manual_seed(case.seed)
    pool = torch.randn(case.num_slots, h.hv, h.dk, h.dv, generator=gen).to(DEVICE) * 0.1
    poison_fresh_slots(pool, case)
    q, k, v, g, beta = qkvgb(h, sum(case.lens), gen)
    q, k, v, beta = (t.to(dtype) for t in (q, k, v, beta))  # g stays fp32, as the model's
    read, write = case.indices()
    expected_pool = pool.clone()
    # The oracle rounds q and k after their L2 norm to the input dtype, as fla documents
    # (a no-op in fp32): a one-token q.k near zero otherwise magnifies that rounding
    # alone past the bound (seen at 16-wide heads, 1.5e-2), which says nothing of fla.
    qn, kn = (l2norm(t.float()).to(dtype) for t in (q, k))
    expected = chunk_gated_delta_rule_torch(inputs=delta_inputs(
        qn, kn, v, g, beta, expected_pool, read, write, h.dk**-0.5, cu_seqlens=case.cu_seqlens,
        use_qk_l2norm=False))
    after = pool.clone()
    # Half the batches without the host offsets: then fla builds its chunk map itself.
    host = case.cu_seqlens.tolist() if case.seed % 2 else None
    # ... and a third with the host indices too (fla's call planned on them)
    host_indices = (case.read, case.write) if host is not None and case.seed % 3 else None
    out = chunk_gated_delta_rule_fla(
        inputs=delta_inputs(q, k, v, g, beta, after, read, write, h.dk**-0.5,
                            cu_seqlens=case.cu_seqlens, cu_seqlens_host=host,
                            host_indices=host_indices),
        kernel=fla_kernel)
    assert out.dtype == dtype
    for i in range(case.num_seqs):
        rows = seq_rows(case, i)
        if case.write[i] < 0:
            assert torch.count_nonzero(out[rows]) == 0, f"PAD sequence {i} produced output"
            continue
        assert rel_rms(out[rows].float(), expected[rows].float()) < FLA_TOL, f"sequence {i}"
        slot = case.write[i]
        assert rel_rms(after[slot], expected_pool[slot]) < FLA_TOL, f"sequence {i} state"
    assert_untouched(pool.cpu(), after.cpu(), case)


GREEDY = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)


def prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(3)
    lengths = (1, 5, 17, 64, 73, 9, 30, 130)  # around and past fla's 64-token chunk
    return [torch.randint(1, 400, (n,), generator=g).tolist() for n in lengths]


def serve(path: str, mode: str, dtype: str, **settings) -> tuple[str, list[list[int]]]:
    """Greedy tokens of the tiny model with ``[kernels] gdn_prefill = mode``, and the
    kernel its gdn backend chose."""
    with LLM(model=path, device="cuda", dtype=dtype, gpu_memory_utilization=0.3, max_num_seqs=8,
             max_model_len=192, gdn_prefill=mode, **settings) as llm:
        kernel = llm.runner.backends.pm.get_plugin("gdn").prefill_kernel
        tokens = [o.token_ids for o in llm.generate(prompts(), GREEDY)]
        assert llm.runner.launcher.nan_rows == 0
    return kernel, tokens


@pytest.mark.gpu
@pytest.mark.parametrize("batched_tokens", [None, 24], ids=["whole", "chunked"])
def test_tiny_qwen3_next_generates_the_same_greedy_tokens_with_fla_and_ours(
    tmp_path, batched_tokens
):
    """float32, forced fla (TF32 products) vs ours: token for token. "chunked" prefills
    in 24-token steps, so fla continues states it wrote itself, beside decode rows. (bf16
    is not compared token for token: perturbing our bf16 prefill by a relative 1e-3 on
    the CPU flipped a sixth of this model's greedy tokens, fla or not.)"""
    pytest.importorskip("fla.ops.gated_delta_rule")
    path = str(write_tiny_checkpoint(tmp_path / "n", kind="qwen3-next"))
    settings = {"max_num_batched_tokens": batched_tokens} if batched_tokens else {}
    ours = serve(path, "ours", "float32", **settings)
    fla = serve(path, "fla", "float32", **settings)
    assert (ours[0], fla[0]) == ("triton", "fla")
    assert fla[1] == ours[1]


@pytest.mark.gpu
def test_auto_serves_a_bf16_model_through_fla(tmp_path):
    pytest.importorskip("fla.ops.gated_delta_rule")
    path = str(write_tiny_checkpoint(tmp_path / "n", kind="qwen3-next"))
    kernel, tokens = serve(path, "auto", "bfloat16")
    assert kernel == "fla"
    assert [len(t) for t in tokens] == [GREEDY.max_tokens] * len(prompts())
