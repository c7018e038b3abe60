"""Deterministic mode's SwiGLU down projection: the invariant GEMM forms ``silu(gate) *
up`` as it loads ``[gate | up]``, bit for bit the activation's kernel followed by the
same product, in either layout of its reduction; a decode-sized batch takes that one
launch, and more rows than ``SILU_MUL_MAX_ROWS`` the activation first. Triton under
the interpreter on the CPU (fp32 and fp16: the interpreter's bf16 is not the GPU's)."""

from __future__ import annotations

from unittest import mock

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvrunner.layers import linear
from kvrunner.layers.fused.dispatch import choose_batch_invariance, kernels_chosen

pytest.importorskip("triton")

from kvrunner.layers.fused import invariant_gemm_triton as gemm  # noqa: E402
from kvrunner.layers.fused import silu_mul_triton as activation  # noqa: E402


def gate_up_rows(m: int, n: int, k: int, dtype: torch.dtype, seed: int):
    g = torch.Generator().manual_seed(seed)
    gate_up = (3 * torch.randn(m, 2 * k, generator=g)).to(dtype)
    return gate_up, torch.randn(n, k, generator=g).to(dtype)


@settings(max_examples=12, deadline=None)
@given(
    st.integers(1, 70), st.integers(1, 130), st.sampled_from([200, 1100, 1600]),
    st.booleans(), st.sampled_from([torch.float32, torch.float16]), st.integers(0, 2**31 - 1),
)  # fmt: skip
def test_the_fused_product_is_the_activation_then_the_product_bit_for_bit(
    m: int, n: int, k: int, walked: bool, dtype: torch.dtype, seed: int
) -> None:
    gate_up, w = gate_up_rows(m, n, k, dtype, seed)
    launch = gemm.invariant_launch(gemm.IN_PROGRAM_ROWS if walked else 1, n, k)
    fused = gemm.invariant_gemm(gate_up, w, launch, silu_mul=True)
    apart = gemm.invariant_gemm(activation.silu_mul_triton(gate_up), w, launch)
    assert torch.equal(fused, apart)


def test_the_fused_product_is_the_swiglu_of_the_torch_reference() -> None:
    """Not only the same bits as the two launches: the right product (K in two slices)."""
    gate_up, w = gate_up_rows(5, 40, 1100, torch.float32, seed=7)
    assert gemm.invariant_reduction(40, 1100)[1] == 2
    gate, up = gate_up.chunk(2, dim=-1)
    torch.testing.assert_close(gemm.invariant_gemm(gate_up, w, silu_mul=True),
                               (torch.nn.functional.silu(gate) * up) @ w.T,
                               rtol=1e-4, atol=1e-3)


def launches(layer: linear.RowParallelLinear, gate_up: torch.Tensor) -> tuple[int, int]:
    """(fused invariant launches, activation launches) of ``forward_silu_mul`` in
    deterministic mode; its result is the activation then the invariant product, bit
    for bit."""
    with (
        mock.patch.object(gemm, "invariant_gemm", wraps=gemm.invariant_gemm) as product,
        mock.patch.object(activation, "silu_mul_triton", wraps=activation.silu_mul_triton) as act,
    ):
        got = layer.forward_silu_mul(gate_up)
    fused = sum(c.kwargs.get("silu_mul", False) for c in product.call_args_list)
    assert torch.equal(got, gemm.invariant_gemm(activation.silu_mul_triton(gate_up),
                                                layer.weight))
    return fused, act.call_count


def test_a_decode_batch_is_one_launch_and_a_long_prompt_takes_the_activation_first(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    layer = linear.RowParallelLinear(24, 40, dtype=torch.float32, device="cpu")
    torch.nn.init.normal_(layer.weight)
    monkeypatch.setattr(gemm, "SILU_MUL_MAX_ROWS", 8)  # the interpreter is slow
    choose_batch_invariance(True)
    try:
        with kernels_chosen(triton_on_cpu=True):
            one, eight, nine = (launches(layer, torch.randn(m, 48)) for m in (1, 8, 9))
    finally:
        choose_batch_invariance(False)
    assert one == eight == (1, 0)
    assert nine == (0, 1)
