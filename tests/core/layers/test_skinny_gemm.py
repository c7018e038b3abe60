"""The skinny-GEMM kernel for decode-sized projections (Triton; under the interpreter
on the CPU): it equals the exact product, whatever the split of K; its reduction
order is fixed; and a model whose projections take it decodes the same greedy tokens.

The interpreter's ``tl.dot`` mishandles bfloat16, so the CPU checks fp32 and fp16;
bf16 is the GPU's case (``benchmarks/bench_skinny_gemm.py`` checks it there)."""

from __future__ import annotations

from unittest import mock

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from kvrunner import LLM, SamplingParams
from kvrunner.layers import linear
from kvrunner.layers.fused.dispatch import (
    SKINNY_GEMM_AUTO_MIN_K,
    SKINNY_GEMM_ENV,
    SKINNY_GEMM_MAX_ROWS,
)
from kvrunner.models.tiny import write_tiny_checkpoint

pytest.importorskip("triton")
from fused_testing import triton_path  # noqa: E402

from kvrunner.layers.fused import skinny_gemm_triton as kernel  # noqa: E402


@given(
    st.integers(1, SKINNY_GEMM_MAX_ROWS), st.integers(1, 200), st.integers(1, 700),
    st.sampled_from([torch.float32, torch.float16]), st.integers(0, 2**31 - 1),
)  # fmt: skip
def test_it_equals_the_exact_product(m: int, n: int, k: int, dtype, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g).to(dtype)
    w = torch.randn(n, k, generator=g).to(dtype)
    exact = x.double() @ w.double().T
    got = kernel.skinny_gemm(x, w).double()
    # fp32 accumulation of k products, then one rounding to the output dtype
    scale = x.double().abs() @ w.double().abs().T
    tol = scale * (k * 2.0**-23 + (2.0**-10 if dtype == torch.float16 else 2.0**-23)) + 1e-30
    assert got.shape == (m, n)
    assert ((got - exact).abs() <= tol).all()


@given(st.integers(1, 20_000), st.integers(1, 20_000))
def test_the_splits_cover_k_and_fill_the_machine(n: int, k: int) -> None:
    splits = kernel.choose_splits(n, k)
    tiles = -(-n // kernel.BLOCK_N)
    assert 1 <= splits <= -(-k // kernel.BLOCK_K)  # no split shallower than one tile
    assert tiles * splits >= kernel.TARGET_PROGRAMS or splits == -(-k // kernel.BLOCK_K)


def test_splitting_k_changes_nothing_but_the_order_and_repeats_exactly() -> None:
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(3, 1000, generator=g), torch.randn(70, 1000, generator=g)
    assert kernel.choose_splits(70, 1000) > 1  # the two-kernel path
    first, again = kernel.skinny_gemm(x, w), kernel.skinny_gemm(x, w)
    assert torch.equal(first, again)
    torch.testing.assert_close(first, x @ w.T, rtol=1e-5, atol=1e-4)


def calls_of(layer: torch.nn.Module, x: torch.Tensor) -> int:
    """How many skinny-GEMM launches ``layer(x)`` made; its result is the exact product."""
    with mock.patch.object(kernel, "skinny_gemm", wraps=kernel.skinny_gemm) as spy:
        torch.testing.assert_close(layer(x), x @ layer.weight.T, rtol=1e-5, atol=1e-3)
    return spy.call_count


@pytest.mark.parametrize(
    ("mode", "deep_row", "shallow_row", "batch"),
    [(None, 1, 0, 0), ("auto", 1, 0, 0), ("1", 1, 1, 1), ("0", 0, 0, 0)],
    ids=["unset", "auto", "on", "off"],
)
def test_projections_take_it_where_the_mode_says_and_never_for_a_prefill(
    monkeypatch, mode: str | None, deep_row: int, shallow_row: int, batch: int
) -> None:
    """``auto`` (the default) sends only one-row products with K >= 2048 (where the
    kernel beat cuBLAS on the H200), ``1`` every decode-sized one, ``0`` none; a
    prefill-sized batch never goes."""
    if mode is None:
        monkeypatch.delenv(SKINNY_GEMM_ENV, raising=False)
    else:
        monkeypatch.setenv(SKINNY_GEMM_ENV, mode)
    deep = linear.ReplicatedLinear(SKINNY_GEMM_AUTO_MIN_K, 8, dtype=torch.float32, device="cpu")
    shallow = linear.ReplicatedLinear(SKINNY_GEMM_AUTO_MIN_K - 1, 8, dtype=torch.float32,
                                      device="cpu")
    for layer in (deep, shallow):
        torch.nn.init.normal_(layer.weight)
    with triton_path(True):
        assert calls_of(deep, torch.randn(1, SKINNY_GEMM_AUTO_MIN_K)) == deep_row
        assert calls_of(shallow, torch.randn(1, SKINNY_GEMM_AUTO_MIN_K - 1)) == shallow_row
        assert calls_of(deep, torch.randn(SKINNY_GEMM_MAX_ROWS, SKINNY_GEMM_AUTO_MIN_K)) == batch
        assert calls_of(deep, torch.randn(SKINNY_GEMM_MAX_ROWS + 1, SKINNY_GEMM_AUTO_MIN_K)) == 0


def test_a_mode_it_does_not_know_is_refused_by_name(monkeypatch) -> None:
    monkeypatch.setenv(SKINNY_GEMM_ENV, "yes")
    with pytest.raises(ValueError, match=f"{SKINNY_GEMM_ENV}='yes'"):
        linear.ReplicatedLinear(4, 4, dtype=torch.float32, device="cpu")(torch.randn(1, 4))


def test_a_model_decodes_the_same_greedy_tokens_through_it(tmp_path, monkeypatch) -> None:
    path = str(write_tiny_checkpoint(tmp_path / "q", kind="qwen3"))
    prompts = [[3, 17, 29, 101], [7, 8, 9, 10, 11], [200, 5]]
    greedy = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    tokens = {}
    for on in (False, True):
        monkeypatch.setenv(SKINNY_GEMM_ENV, "1" if on else "0")
        with triton_path(True), LLM(model=path, device="cpu", dtype="float32", max_num_seqs=4,
                                    max_model_len=64, enforce_eager=True) as llm:
            spy = mock.patch.object(kernel, "skinny_gemm", wraps=kernel.skinny_gemm)
            with spy as called:
                tokens[on] = [o.token_ids for o in llm.generate(prompts, greedy)]
            assert called.called == on
    assert tokens[True] == tokens[False]
