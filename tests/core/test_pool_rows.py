"""A pool read row by row (the step audit's view): each row's checksums are the same on
the Triton and torch paths, whatever the view's strides, and a changed element shows in
its own row and no other."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvrunner.layers.fused.dispatch import kernels_chosen
from kvrunner.plugin_api import BackendError
from kvrunner.runner.pools.pool_rows import pool_rows, row_checksums
from kvrunner.runner.pools.row_checksums_triton import inner_dims

DTYPES = [torch.float32, torch.bfloat16, torch.uint8, torch.int64]
WORDS = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


@st.composite
def strided_rows(draw: st.DrawFn) -> torch.Tensor:
    """A random pool of 2-5 dims viewed with a random dimension as the rows, as a
    backend's cache_rows does (``pool.permute(...)``, then the rows flattened)."""
    shape = draw(st.lists(st.integers(1, 5), min_size=2, max_size=5))
    dtype = draw(st.sampled_from(DTYPES))
    pool = torch.randint(-1000, 1000, shape).to(dtype)
    order = draw(st.permutations(range(len(shape))))
    return pool.permute(*order)


@settings(max_examples=40, deadline=None)
@given(strided_rows())
def test_the_kernel_equals_the_torch_reference_on_any_strided_view(rows: torch.Tensor) -> None:
    with kernels_chosen(triton_on_cpu=False):
        reference = row_checksums(rows)
    with kernels_chosen(triton_on_cpu=True):
        got = row_checksums(rows)
    assert torch.equal(got, reference)
    assert reference.shape == (rows.shape[0], 2)


@settings(max_examples=40, deadline=None)
@given(strided_rows(), st.data(), st.booleans())
def test_a_changed_element_shows_in_its_row_and_no_other(rows, data, triton: bool) -> None:
    index = tuple(data.draw(st.integers(0, n - 1)) for n in rows.shape)
    with kernels_chosen(triton_on_cpu=triton):
        before = row_checksums(rows)
        bits = rows.view(WORDS[rows.element_size()])  # flip one bit of the element's raw word
        bits[index] = bits[index] ^ 1
        changed = (row_checksums(rows) != before).any(dim=1).nonzero().flatten().tolist()
    assert changed == [index[0]]


def test_inner_dimensions_merge_where_the_layout_allows() -> None:
    pool = torch.zeros(2, 6, 4, 3, 8)  # paged's [2, blocks, block_size, heads, dim]
    rows = pool.permute(1, 2, 0, 3, 4).flatten(0, 1)  # one row per KV slot
    assert inner_dims(rows) == [(2, 6 * 4 * 3 * 8), (3 * 8, 1)]


def test_cache_rows_that_copies_is_refused_naming_the_backend_and_pool() -> None:
    pools = {"mine.kv.0": torch.zeros(4, 3)}
    with pytest.raises(BackendError, match=r"backend 'mine': cache_rows\('kv.0', pool\) "
                                           r"returned a tensor that is not a view"):
        pool_rows(pools, {"mine": lambda name, pool: ("kv", pool.clone())})
    assert pool_rows(pools, {"mine": lambda name, pool: ("kv", pool.t())})[0].layer == 0
