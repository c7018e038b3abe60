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
from kvrunner.config import ConfigError, EngineConfig
from kvrunner.layers import linear
from kvrunner.layers.fused.dispatch import SKINNY_GEMM_MAX_ROWS, kernels_chosen
from kvrunner.models.tiny import write_tiny_checkpoint

pytest.importorskip("triton")
from fused_testing import triton_path  # noqa: E402

from kvrunner.layers.fused import skinny_gemm_triton as kernel  # noqa: E402


def assert_exact(x: torch.Tensor, w: torch.Tensor, got: torch.Tensor) -> None:
    """``got`` is ``x @ w.T`` to fp32 accumulation of k products, then one rounding to
    the output dtype. A result below fp16's normal range rounds to its subnormal
    spacing of 2**-24, an absolute error of up to 2**-25 that no relative bound covers."""
    k = x.shape[-1]
    exact = x.double() @ w.double().T
    scale = x.double().abs() @ w.double().abs().T
    half = x.dtype == torch.float16
    tol = scale * (k * 2.0**-23 + (2.0**-10 if half else 2.0**-23)) + (2.0**-25 if half else 1e-30)
    assert got.shape == exact.shape
    assert ((got.double() - exact).abs() <= tol).all()


def random_operands(m: int, n: int, k: int, dtype: torch.dtype, seed: int):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(m, k, generator=g).to(dtype), torch.randn(n, k, generator=g).to(dtype)


@given(
    st.integers(1, SKINNY_GEMM_MAX_ROWS), st.integers(1, 200), st.integers(1, 700),
    st.sampled_from([torch.float32, torch.float16]), st.integers(0, 2**31 - 1),
)  # fmt: skip
def test_it_equals_the_exact_product(m: int, n: int, k: int, dtype, seed: int) -> None:
    x, w = random_operands(m, n, k, dtype, seed)
    assert_exact(x, w, kernel.skinny_gemm(x, w))


@given(
    st.booleans(), st.integers(1, 16), st.integers(1, 120), st.integers(1, 400),
    st.sampled_from([8, 16, 32, 64]), st.sampled_from([16, 32, 64, 128, 256]),
    st.integers(1, 9), st.sampled_from([torch.float32, torch.float16]), st.integers(0, 2**31 - 1),
)  # fmt: skip
def test_every_launch_equals_the_exact_product(gemv: bool, m: int, n: int, k: int,
                                               block_n: int, block_k: int, splits: int,
                                               dtype, seed: int) -> None:
    """Any tile shape and split of K, the one-row kernel or the tensor-core one: the
    launch a benchmark sweeps changes the speed, never the product."""
    m = 1 if gemv else m
    block_n = block_n if gemv else max(16, block_n)  # tl.dot takes tiles of 16 and up
    launch = kernel.SkinnyLaunch(block_n, block_k, splits, gemv)
    x, w = random_operands(m, n, k, dtype, seed)
    assert_exact(x, w, kernel.skinny_gemm(x, w, launch))


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
    ("mode", "one_row", "batch"),
    [(None, 1, 0), ("auto", 1, 0), ("on", 1, 1), ("off", 0, 0)],
    ids=["unset", "auto", "on", "off"],
)
def test_projections_take_it_where_the_mode_says_and_never_for_a_prefill(
    mode: str | None, one_row: int, batch: int
) -> None:
    """``auto`` (the default) sends only one-row products (where the kernel beat cuBLAS
    on the H200), ``on`` every decode-sized one, ``off`` none; a prefill-sized batch
    never goes."""
    chosen = {} if mode is None else {"skinny_gemm": mode}
    layer = linear.ReplicatedLinear(48, 40, dtype=torch.float32, device="cpu")
    torch.nn.init.normal_(layer.weight)
    with triton_path(True), kernels_chosen(**chosen):
        assert calls_of(layer, torch.randn(1, 48)) == one_row
        assert calls_of(layer, torch.randn(2, 48)) == batch
        assert calls_of(layer, torch.randn(SKINNY_GEMM_MAX_ROWS, 48)) == batch
        assert calls_of(layer, torch.randn(SKINNY_GEMM_MAX_ROWS + 1, 48)) == 0


def test_one_row_takes_the_gemv_kernel_split_only_past_32_kb_a_program() -> None:
    """The measured launch: 8 x 512 GEMV tiles; an unsplit program streams at most
    32 KB of weight, past that K is split to fill the machine."""
    unsplit = kernel.default_launch(1, 1024, 2048)  # 0.6B o_proj: 8 x 2048 x 2 B = 32 KB
    assert (unsplit.gemv, unsplit.block_n, unsplit.block_k, unsplit.splits) == (True, 8, 512, 1)
    split = kernel.default_launch(1, 1024, 3072)  # 0.6B down_proj: 48 KB a program
    assert split.gemv and split.splits == kernel.choose_splits(1024, 3072, 8, 512) > 1
    assert kernel.default_launch(1, 1024, 3072, itemsize=4).splits > 1  # fp32: 96 KB
    assert kernel.default_launch(1, 8192, 3072).splits == 1  # 1024 tiles fill it already
    assert not kernel.default_launch(2, 1024, 2048).gemv


def test_a_mode_it_does_not_know_is_refused_by_name() -> None:
    with pytest.raises(ConfigError, match="skinny_gemm must be one of auto, on, off; got 'yes'"):
        EngineConfig.load(skinny_gemm="yes")


def test_a_model_decodes_the_same_greedy_tokens_through_it(tmp_path) -> None:
    path = str(write_tiny_checkpoint(tmp_path / "q", kind="qwen3"))
    prompts = [[3, 17, 29, 101], [7, 8, 9, 10, 11], [200, 5]]
    greedy = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    tokens = {}
    for on in (False, True):
        with LLM(model=path, device="cpu", dtype="float32", max_num_seqs=4, max_model_len=64,
                 enforce_eager=True, triton_on_cpu=True, skinny_gemm="on" if on else "off") as llm:
            spy = mock.patch.object(kernel, "skinny_gemm", wraps=kernel.skinny_gemm)
            with spy as called:
                tokens[on] = [o.token_ids for o in llm.generate(prompts, greedy)]
            assert called.called == on
    assert tokens[True] == tokens[False]
