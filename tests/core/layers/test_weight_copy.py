"""Loading a weight from host memory: the staged copy gives exactly the values of
``dst.copy_(src)``, whatever the chunking, the source's strides or the cast, and the
caller's tensor is free to change the moment the copy returns."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from kvrunner.layers.weight_copy import (
    STAGE_CHUNK_BYTES,
    STAGE_MIN_BYTES,
    copy_weight_,
    needs_staging,
    staged_copy_,
)

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def source(shape, dtype, layout, gen) -> torch.Tensor:
    """A host tensor of ``shape`` laid out as a checkpoint shard may be: contiguous,
    a column slice of a wider tensor, or a transposed view."""
    if layout == "columns" and len(shape) >= 2:
        wide = torch.randn(*shape[:-1], shape[-1] * 2 + 1, generator=gen).to(dtype)
        return wide[..., 1 : shape[-1] + 1]
    if layout == "transposed" and len(shape) >= 2:
        reversed_dims = range(len(shape) - 1, -1, -1)
        return torch.randn(*reversed(shape), generator=gen).to(dtype).permute(*reversed_dims)
    return torch.randn(*shape, generator=gen).to(dtype)


@given(
    shape=st.lists(st.integers(1, 9), min_size=1, max_size=3),
    src_dtype=st.sampled_from(DTYPES),
    dst_dtype=st.sampled_from(DTYPES),
    layout=st.sampled_from(["contiguous", "columns", "transposed"]),
    chunk_bytes=st.integers(1, 600),
    seed=st.integers(0, 2**31),
)
def test_a_staged_copy_equals_a_plain_copy(shape, src_dtype, dst_dtype, layout, chunk_bytes,
                                           seed) -> None:
    src = source(shape, src_dtype, layout, torch.Generator().manual_seed(seed))
    expected = torch.empty(src.shape, dtype=dst_dtype).copy_(src)
    chunks: list[torch.Size] = []

    def stage(chunk_shape, dtype):
        chunks.append(chunk_shape)
        return torch.full(chunk_shape, float("nan"), dtype=dtype)  # stale bytes show

    dst = torch.full(src.shape, 7.0, dtype=dst_dtype)
    staged_copy_(dst, src, stage=stage, chunk_bytes=chunk_bytes)
    assert torch.equal(dst, expected)
    row_bytes = dst[0].numel() * dst.element_size()
    assert sum(c[0] for c in chunks) == dst.shape[0]  # every row once
    assert all(c[0] == 1 or c[0] * row_bytes <= chunk_bytes for c in chunks)


def test_a_shape_mismatch_names_both_shapes_and_leaves_the_parameter() -> None:
    dst = torch.zeros(4, 3)
    with pytest.raises(ValueError, match=r"expected shape \(4, 3\), got \(3, 4\)"):
        copy_weight_(dst, torch.ones(3, 4))
    with pytest.raises(ValueError, match=r"expected shape \(4, 3\), got \(3,\)"):
        copy_weight_(dst, torch.ones(3))  # would broadcast under copy_
    assert not dst.any()


def test_only_big_pageable_host_tensors_bound_for_cuda_are_staged() -> None:
    big = torch.empty(STAGE_MIN_BYTES // 4, dtype=torch.float32)
    assert not needs_staging(torch.empty_like(big), big)  # a CPU parameter
    assert not needs_staging(torch.empty(()), torch.empty(()))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("layout", ["contiguous", "columns", "transposed"])
@pytest.mark.parametrize(("src_dtype", "dst_dtype"),
                         [(torch.bfloat16, torch.bfloat16), (torch.float32, torch.bfloat16)])
def test_on_cuda_a_pageable_tensor_arrives_whole_and_is_free_at_once(
    layout, src_dtype, dst_dtype
) -> None:
    """Several pinned chunks in flight; the caller overwrites its tensor right after."""
    rows = 3 * STAGE_CHUNK_BYTES // (1024 * 2) + 5
    src = source((rows, 1024), src_dtype, layout, torch.Generator().manual_seed(rows))
    expected = torch.empty(src.shape, dtype=dst_dtype).copy_(src)
    dst = torch.zeros(src.shape, dtype=dst_dtype, device="cuda")
    assert needs_staging(dst, src)
    copy_weight_(dst, src)
    src.fill_(0)  # the copy has returned: the source is the caller's again
    copy_weight_(torch.empty_like(dst), torch.randn(src.shape).to(src_dtype))  # reuse buffers
    assert torch.equal(dst.cpu(), expected)
