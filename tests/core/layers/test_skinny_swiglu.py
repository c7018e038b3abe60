"""A decode batch's SwiGLU activation fused into its down projection (the skinny GEMM
reads ``[gate | up]`` and forms ``silu(gate) * up`` as it streams the weight): the
product is bit for bit the activation's kernel followed by the same launch, the GEMV
for one row and the tensor-core tile for more, one row (and a decode batch under
``skinny_gemm = "on"``) takes one launch instead of two, and more rows keep the
two steps. Triton under the interpreter on
the CPU (fp32 and fp16: the interpreter's bf16 is not the GPU's)."""

from __future__ import annotations

from unittest import mock

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given
from hypothesis import strategies as st

from kvrunner.layers import linear
from kvrunner.layers.fused.dispatch import SKINNY_GEMM_MAX_ROWS, kernels_chosen

pytest.importorskip("triton")
from fused_testing import triton_path  # noqa: E402

from kvrunner.layers.fused import silu_mul_triton as activation  # noqa: E402
from kvrunner.layers.fused import skinny_gemm_triton as kernel  # noqa: E402


def gate_up_rows(k: int, n: int, dtype: torch.dtype, seed: int, m: int = 1):
    g = torch.Generator().manual_seed(seed)
    gate_up = (3 * torch.randn(m, 2 * k, generator=g)).to(dtype)
    return gate_up, torch.randn(n, k, generator=g).to(dtype)


@given(
    st.integers(1, 120), st.integers(1, 400), st.sampled_from([4, 8, 16]),
    st.sampled_from([16, 64, 128, 512]), st.integers(1, 6),
    st.sampled_from([torch.float32, torch.float16]), st.integers(0, 2**31 - 1),
)  # fmt: skip
def test_the_fused_product_is_the_activation_then_the_product_bit_for_bit(
    n: int, k: int, block_n: int, block_k: int, splits: int, dtype, seed: int
) -> None:
    gate_up, w = gate_up_rows(k, n, dtype, seed)
    launch = kernel.SkinnyLaunch(block_n, block_k, splits, gemv=True)
    fused = kernel.skinny_gemm(gate_up, w, launch, silu_mul=True)
    assert torch.equal(fused, kernel.skinny_gemm(activation.silu_mul_triton(gate_up), w, launch))


@given(
    st.integers(2, 64), st.integers(1, 120), st.integers(1, 300), st.sampled_from([16, 32]),
    st.sampled_from([16, 64]), st.integers(1, 4),
    st.sampled_from([torch.float32, torch.float16]), st.integers(0, 2**31 - 1),
)  # fmt: skip
def test_more_rows_fuse_it_into_the_tensor_core_tile_bit_for_bit(
    m: int, n: int, k: int, block_n: int, block_k: int, splits: int, dtype, seed: int
) -> None:
    gate_up, w = gate_up_rows(k, n, dtype, seed, m)
    launch = kernel.SkinnyLaunch(block_n, block_k, splits)
    fused = kernel.skinny_gemm(gate_up, w, launch, silu_mul=True)
    assert torch.equal(fused, kernel.skinny_gemm(activation.silu_mul_triton(gate_up), w, launch))


def launches(layer: linear.RowParallelLinear, gate_up: torch.Tensor) -> tuple[int, int]:
    """(skinny-GEMM launches, activation launches) of ``forward_silu_mul``; its result
    is the torch SwiGLU's."""
    with (
        mock.patch.object(kernel, "skinny_gemm", wraps=kernel.skinny_gemm) as gemm,
        mock.patch.object(activation, "silu_mul_triton", wraps=activation.silu_mul_triton) as act,
    ):
        got = layer.forward_silu_mul(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    torch.testing.assert_close(got, F.linear(F.silu(gate) * up, layer.weight), rtol=1e-5,
                               atol=1e-4)
    return gemm.call_count, act.call_count


@pytest.mark.parametrize("mode", ["auto", "on", "off"])
def test_one_row_is_one_launch_and_more_rows_as_the_mode_says(mode: str) -> None:
    layer = linear.RowParallelLinear(24, 40, dtype=torch.float32, device="cpu")
    torch.nn.init.normal_(layer.weight)
    with triton_path(True), kernels_chosen(skinny_gemm=mode):
        one = launches(layer, torch.randn(1, 48))
        five = launches(layer, torch.randn(5, 48))
        past = launches(layer, torch.randn(SKINNY_GEMM_MAX_ROWS + 1, 48))
    fused, apart = (1, 0), (0, 1)  # apart: the activation, then cuBLAS
    assert one == (apart if mode == "off" else fused)
    # auto fuses one row only (measured slower from 8 rows on); on fuses a decode batch
    assert five == (fused if mode == "on" else apart)
    assert past == apart  # past a decode batch every mode keeps the two steps


def test_a_single_sequence_decodes_the_same_greedy_tokens_with_it_on_and_off(
    tmp_path,
) -> None:
    """One sequence: every decode step's projections and MLPs are one row, so ``auto``
    sends them through the GEMV and the fused SwiGLU; ``off`` keeps torch's."""
    from kvrunner import LLM, SamplingParams
    from kvrunner.models.tiny import write_tiny_checkpoint

    path = str(write_tiny_checkpoint(tmp_path / "q", kind="qwen3"))
    greedy = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    tokens, fused = {}, {}
    for mode in ("auto", "off"):
        with (
            LLM(model=path, device="cpu", dtype="float32", max_num_seqs=2, max_model_len=64,
                enforce_eager=True, triton_on_cpu=True, skinny_gemm=mode) as llm,
            mock.patch.object(kernel, "skinny_gemm", wraps=kernel.skinny_gemm) as gemm,
        ):
            tokens[mode] = llm.generate([[3, 17, 29, 101]], greedy)[0].token_ids
        fused[mode] = sum(c.kwargs.get("silu_mul", False) for c in gemm.call_args_list)
    assert fused["off"] == 0 and fused["auto"] > 0
    assert tokens["auto"] == tokens["off"]
