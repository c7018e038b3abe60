"""The batch-invariant products at tiny shapes: the Triton kernel under the
interpreter and the CPU's torch path give a row the same bits whatever else is
computed with it (end to end: test_batch_invariance.py; on the GPU, with the
attention too: test_deterministic_gpu.py)."""

from __future__ import annotations

import pytest
import torch

from kvrunner.layers.batch_invariant import rowwise_linear

triton = pytest.importorskip("triton")


def test_the_invariant_gemm_gives_a_row_the_same_bits_in_any_batch() -> None:
    from kvrunner.layers.fused.invariant_gemm_triton import invariant_gemm, invariant_reduction

    torch.manual_seed(0)
    weight = torch.randn(40, 1100)  # K split in two: the split sum is exercised
    assert invariant_reduction(40, 1100)[1] == 2
    rows = torch.randn(70, 1100)
    whole = invariant_gemm(rows, weight)  # two row tiles
    torch.testing.assert_close(whole, rows @ weight.T, atol=1e-3, rtol=1e-4)
    # Under the interpreter ``tl.dot`` is numpy's matmul, whose micro-kernel rounds a
    # row by its place inside the tile; on a GPU the MMA does not. So here each slice
    # starts at a tile boundary (its rows keep their places) and the launch's
    # independence of the row count (other tiles, fewer rows, the split sum) is what
    # is shown; test_deterministic_gpu.py shows the rest.
    for lo, hi in ((0, 1), (0, 5), (0, 64), (64, 65), (64, 70)):
        assert torch.equal(invariant_gemm(rows[lo:hi], weight), whole[lo:hi])


def test_the_rowwise_torch_product_gives_a_row_the_same_bits_in_any_batch() -> None:
    torch.manual_seed(1)
    weight, rows = torch.randn(48, 96), torch.randn(33, 96)
    whole = rowwise_linear(rows, weight)
    for lo, hi in ((0, 1), (7, 8), (2, 31)):
        assert torch.equal(rowwise_linear(rows[lo:hi], weight), whole[lo:hi])


def test_the_invariant_gemm_layouts_of_one_reduction_give_the_same_bits() -> None:
    """A product's layout follows the row count (a program per K slice for decode, one
    program walking every slice for long prefills); its bits follow the reduction only."""
    from kvrunner.layers.fused.invariant_gemm_triton import (
        IN_PROGRAM_ROWS,
        invariant_gemm,
        invariant_launch,
    )

    torch.manual_seed(2)
    # Three slices: two would add the same whichever came first.
    weight, rows = torch.randn(40, 1600), torch.randn(70, 1600)
    sliced = invariant_launch(1, 40, 1600)
    walked = invariant_launch(IN_PROGRAM_ROWS, 40, 1600)
    assert sliced.splits == walked.splits == 3
    assert not sliced.in_program and walked.in_program
    assert torch.equal(invariant_gemm(rows, weight, sliced), invariant_gemm(rows, weight, walked))


def test_a_product_of_enough_output_tiles_walks_its_slices_in_one_program(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """With ``WALK_TILES`` set, a decode-sized product whose output tiles alone number
    that many walks its slices in one program (no partials), to the sliced bits; fewer
    tiles keep a program per slice; unset, the row count alone decides."""
    from kvrunner.layers.fused import invariant_gemm_triton as gemm

    torch.manual_seed(4)
    wide, rows = torch.randn(256, 2048), torch.randn(64, 2048)
    assert not gemm.invariant_launch(64, 256, 2048).in_program
    monkeypatch.setattr(gemm, "WALK_TILES", 4)
    walked = gemm.invariant_launch(64, 256, 2048)  # one row tile by four column tiles
    assert walked.splits == 4 and walked.in_program
    assert not gemm.invariant_launch(64, 192, 2048).in_program  # three tiles
    monkeypatch.setattr(gemm, "WALK_TILES", None)
    sliced = gemm.invariant_launch(64, 256, 2048)
    assert not sliced.in_program
    assert torch.equal(gemm.invariant_gemm(rows, wide, walked),
                       gemm.invariant_gemm(rows, wide, sliced))


def test_a_tiles_last_program_adds_its_slices_to_the_second_kernels_bits() -> None:
    """A slice-per-program product is one launch: the tile's last program to finish
    adds the slices, from zero in slice order, as the second kernel would; and it
    leaves the tile counters it counted on at zero for the next launch."""
    import attrs

    from kvrunner.layers.fused import invariant_gemm_triton as gemm

    torch.manual_seed(3)
    weight, rows = torch.randn(200, 2100), torch.randn(70, 2100)
    one_launch = gemm.invariant_launch(1, 200, 2100)
    assert one_launch.splits == 4 and not one_launch.in_program
    assert one_launch.last_program_sums
    two_launches = attrs.evolve(one_launch, last_program_sums=False)
    before = gemm._COUNTERS._cursor.get(rows.device, 0)
    summed_by_last = gemm.invariant_gemm(rows, weight, one_launch)
    tiles = 2 * 4  # two row tiles by four column tiles
    assert gemm._COUNTERS._cursor[rows.device] == before + tiles
    assert torch.equal(summed_by_last, gemm.invariant_gemm(rows, weight, two_launches))
    assert int(gemm._COUNTERS._rings[rows.device].abs().sum()) == 0
    torch.testing.assert_close(summed_by_last, rows @ weight.T, atol=1e-3, rtol=1e-4)
