"""The compiled kernels on CUDA: realistic shapes, bf16, split-KV, big pools, CUDA graphs.

Skipped without CUDA (the ``gpu`` marker). The CPU suite runs the same kernels under
the interpreter at tiny shapes; these check what only a real compile can get wrong:
``tl.dot`` tile constraints, int32 address overflow, TF32 leaking into fp32, and
replay of a captured graph whose metadata is filled in place.
"""

from __future__ import annotations

import pytest
import torch
from paged_cases import PagedCase

from kvrunner.plugin_api import ModelSpec
from kvrunner.runner.step.step_metadata import StepMetadataBuilder
from kvrunner.testing.harness import backend_manager
from kvrunner_paged.kv_format import FP8_DTYPE
from kvrunner_paged.ops.paged_attention.decode import paged_decode_attention
from kvrunner_paged.ops.paged_attention.inputs import NewKV, PagedAttentionInputs
from kvrunner_paged.ops.paged_attention.naive import naive_paged_attention
from kvrunner_paged.ops.paged_attention.prefill import (
    LONG_RUN_LAUNCH,
    paged_prefill_attention,
)
from kvrunner_paged.ops.store_kv.naive import naive_store_kv
from kvrunner_paged.ops.store_kv.store import store_kv

pytestmark = pytest.mark.gpu
CUDA = torch.device("cuda")
# bf16 keeps 8 significant bits: inputs, the probabilities fed to the PV product and the
# output are each rounded once, so a few units of 2^-8 of error is expected.
BF16_TOL = {"rtol": 2**-6, "atol": 2**-6}
FP32_TOL = {"rtol": 1e-4, "atol": 1e-5}


def _case(
    num_blocks: int, block_size: int, lens: list[tuple[int, int]], heads: tuple[int, int] = (8, 2)
) -> PagedCase:
    """Sequences ``(q_len, context_len)`` on blocks from the top of a shuffled pool;
    ``heads``: (query heads, kv heads)."""
    gen = torch.Generator().manual_seed(0)
    free = (torch.randperm(num_blocks, generator=gen)).tolist()[::-1]
    tables = []
    for _, ctx in lens:
        tables.append(tuple(free.pop() for _ in range(-(-ctx // block_size))))
    return PagedCase(
        block_size=block_size, num_blocks=num_blocks, num_heads=heads[0], num_kv_heads=heads[1],
        head_dim=128, max_blocks_per_seq=max(len(t) for t in tables) + 3,
        query_lens=tuple(q for q, _ in lens), context_lens=tuple(c for _, c in lens),
        block_tables=tuple(tables), num_pad_rows=2, seed=0,
    )


def _inputs(case: PagedCase, dtype: torch.dtype, rows: int, seqs: int) -> dict[str, torch.Tensor]:
    gen = case.generator()
    pool = case.pool(gen, poison_unread=False).to(dtype)
    return {
        "q": torch.randn((rows, case.num_heads, case.head_dim), generator=gen).to(dtype),
        "k_cache": pool[0],
        "v_cache": pool[1],
        "block_tables": case.block_table_tensor(seqs),
        "context_lens": case.context_lens_tensor(seqs),
    }


def _to(x: dict[str, torch.Tensor], device: torch.device) -> dict[str, torch.Tensor]:
    return {k: v.to(device) for k, v in x.items()}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_splits", [1, 3, 8])
def test_compiled_decode_matches_reference(dtype: torch.dtype, num_splits: int) -> None:
    case = _case(64, 16, [(1, 1), (1, 17), (1, 250), (1, 64)])
    rows = case.num_seqs + case.num_pad_rows
    x = _inputs(case, dtype, rows, rows)
    out = paged_decode_attention(inputs=PagedAttentionInputs(**_to(x, CUDA), scale=case.scale),
                                 num_splits=num_splits)
    starts = torch.arange(rows + 1, dtype=torch.int32)
    ref = naive_paged_attention(**x, query_start_loc=starts, scale=case.scale)
    tol = FP32_TOL if dtype == torch.float32 else BF16_TOL
    torch.testing.assert_close(out.cpu().float(), ref, **tol)


@pytest.mark.parametrize("pool_dtype", [torch.bfloat16, FP8_DTYPE], ids=["bf16", "fp8"])
@pytest.mark.parametrize("num_stages", [2, 3])
@pytest.mark.parametrize("num_splits", [1, 3])
def test_a_pipelined_key_walk_gives_the_unpipelined_walks_bits(
    pool_dtype: torch.dtype, num_stages: int, num_splits: int
) -> None:
    """Pipelining the decode walk over whole key tiles only stages their loads: every
    output bit is the one-stage walk's, over a bf16 pool and an e4m3 one, for contexts
    of whole tiles, part tiles and less than one."""
    case = _case(64, 16, [(1, 1), (1, 17), (1, 250), (1, 64), (1, 200), (1, 128)])
    rows = case.num_seqs + case.num_pad_rows
    x = _to(_inputs(case, torch.bfloat16, rows, rows), CUDA)
    x["k_cache"], x["v_cache"] = x["k_cache"].to(pool_dtype), x["v_cache"].to(pool_dtype)
    inputs = PagedAttentionInputs(**x, scale=case.scale)
    plain = paged_decode_attention(inputs=inputs, num_splits=num_splits, num_stages=1)
    piped = paged_decode_attention(inputs=inputs, num_splits=num_splits, num_stages=num_stages)
    assert plain.abs().sum() > 0
    assert torch.equal(piped, plain)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_splits", [1, 3, 8])
def test_compiled_fused_store_decode_stores_then_attends(
    dtype: torch.dtype, num_splits: int
) -> None:
    """The decode launch that stores this step's keys and values: the pool afterwards is
    the reference store's, the output the reference attention's over it."""
    case = _case(64, 16, [(1, 1), (1, 17), (1, 250), (1, 64)])
    rows = case.num_seqs + case.num_pad_rows
    x = _inputs(case, dtype, rows, rows)
    gen = torch.Generator().manual_seed(1)
    kv = torch.randn((rows, 2 * case.num_kv_heads, case.head_dim), generator=gen).to(dtype)
    k, v, slots = kv[:, : case.num_kv_heads], kv[:, case.num_kv_heads :], case.slot_mapping()
    on = _to(x, CUDA)
    new_kv = NewKV(k=k.to(CUDA), v=v.to(CUDA), slot_mapping=slots.to(CUDA))
    out = paged_decode_attention(
        inputs=PagedAttentionInputs(**on, scale=case.scale, new_kv=new_kv), num_splits=num_splits)
    naive_store_kv(k, v, x["k_cache"], x["v_cache"], slots)
    assert torch.equal(on["k_cache"].cpu(), x["k_cache"])
    assert torch.equal(on["v_cache"].cpu(), x["v_cache"])
    starts = torch.arange(rows + 1, dtype=torch.int32)
    ref = naive_paged_attention(**x, query_start_loc=starts, scale=case.scale)
    tol = FP32_TOL if dtype == torch.float32 else BF16_TOL
    torch.testing.assert_close(out.cpu().float(), ref, **tol)


def _prefill_matches_reference(case, dtype: torch.dtype, **launch: int) -> None:
    """The compiled prefill on ``case`` equals the fp32 reference within ``dtype``'s
    tolerance (``launch``: overrides of the default launch parameters)."""
    x = _inputs(case, dtype, case.num_tokens, case.num_seqs)
    x["query_start_loc"] = case.query_start_loc()
    inputs = PagedAttentionInputs(**_to(x, CUDA), scale=case.scale, num_seqs=case.num_seqs,
                                  max_query_len=max(case.query_lens))
    out = paged_prefill_attention(inputs=inputs, **launch)
    ref = naive_paged_attention(**x, scale=case.scale)
    tol = FP32_TOL if dtype == torch.float32 else BF16_TOL
    torch.testing.assert_close(out.cpu().float(), ref, **tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_compiled_prefill_matches_reference(dtype: torch.dtype) -> None:
    _prefill_matches_reference(_case(64, 16, [(70, 70), (1, 33), (40, 200), (5, 5)]), dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads", [(16, 8), (32, 8), (12, 4)])
def test_compiled_prefill_packs_each_gqa_group(dtype: torch.dtype, heads: tuple[int, int]) -> None:
    """The default launch at the 0.6B / 8B groups (2, 4) and a padded one (3): queries
    span several 128-row tiles, prefixes end mid-block, a decode row rides along."""
    case = _case(96, 16, [(300, 300), (1, 77), (129, 400), (33, 50)], heads)
    _prefill_matches_reference(case, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads", [(16, 8), (32, 8), (12, 4)])
def test_the_long_run_launch_computes_the_reference(dtype: torch.dtype, heads) -> None:
    """The short test prompts take each dtype's default launch; runs of 4,096 queries
    and more take the long-run one. It too, at every group, over the same batch."""
    case = _case(96, 16, [(300, 300), (1, 77), (129, 400), (33, 50)], heads)
    launch = LONG_RUN_LAUNCH[dtype]
    _prefill_matches_reference(
        case, dtype, block_m=launch.block_m, block_n=launch.block_n,
        num_warps=launch.num_warps, num_stages=launch.num_stages,
    )


def test_pools_past_two_to_the_31_elements_are_addressed_in_int64() -> None:
    """Blocks near the top of a 2.3e9-element cache: int32 offsets would wrap."""
    blocks, block_size, kv_heads, dim = 140_000, 16, 8, 128
    k_cache = torch.zeros((blocks, block_size, kv_heads, dim), dtype=torch.bfloat16, device=CUDA)
    v_cache = torch.zeros_like(k_cache)
    assert k_cache.numel() > 2**31
    top = [blocks - 1, blocks - 7]
    table = torch.tensor([top], dtype=torch.int32, device=CUDA)
    slots = torch.tensor([b * block_size + o for b in top for o in range(block_size)], device=CUDA)
    k = torch.randn((len(slots), kv_heads, dim), device=CUDA).bfloat16()
    v = torch.randn_like(k)
    store_kv(k=k, v=v, k_cache=k_cache, v_cache=v_cache, slot_mapping=slots)
    assert torch.equal(k_cache[top[1], 3], k[block_size + 3])
    q = torch.randn((1, 32, dim), device=CUDA).bfloat16()
    lens = torch.tensor([2 * block_size], dtype=torch.int32, device=CUDA)
    out = paged_decode_attention(inputs=PagedAttentionInputs(
        q=q, k_cache=k_cache, v_cache=v_cache, block_tables=table, context_lens=lens,
        scale=dim**-0.5))
    small_k = torch.stack([k_cache[b] for b in top]).cpu()
    small_v = torch.stack([v_cache[b] for b in top]).cpu()
    ref = naive_paged_attention(
        q.cpu(), small_k, small_v, torch.tensor([[0, 1]], dtype=torch.int32),
        torch.tensor([0, 1], dtype=torch.int32), lens.cpu(), dim**-0.5,
    )
    torch.testing.assert_close(out.cpu().float(), ref, **BF16_TOL)


def test_cuda_graph_replay_reads_metadata_filled_after_capture() -> None:
    """Capture a decode step on a blanked slot_mapping, then replay a real padded batch."""
    case = _case(48, 16, [(1, 20), (1, 129), (1, 3)])
    spec = ModelSpec(num_layers=1, layer_types=("full_attention",), num_heads=8,
                     num_kv_heads=2, head_dim=128)
    mgr = backend_manager({"full_attention": "paged"}, spec, block_size=16, max_num_seqs=8,
                          max_num_batched_tokens=64, max_model_len=1024, device="cuda",
                          use_triton=True, dtype=torch.bfloat16)
    (pool,) = mgr.allocate_cache(num_blocks=case.num_blocks, num_slots=9).values()
    pool.copy_(case.pool(case.generator(), poison_unread=False).to(pool))
    mgr.persistent_buffers(max_batch=8, max_tokens=64)
    step_builder = StepMetadataBuilder(max_batch=8, max_tokens=64, max_blocks_per_seq=64,
                                       device=torch.device(CUDA))
    for target in mgr.cache_write_targets():
        target.buffer.fill_(target.pad_value)
    rows = case.num_seqs + case.num_pad_rows
    ctx = mgr.build_capture_metadata(step_builder.fill_capture(rows))
    layer = mgr.make_layer(layer_index=0, layer_type="full_attention")
    q = torch.zeros((rows, 8, 128), dtype=torch.bfloat16, device=CUDA)
    k = torch.zeros((rows, 2, 128), dtype=torch.bfloat16, device=CUDA)
    v = torch.zeros_like(k)
    snapshot = pool.clone()
    layer.forward(q, k, v, ctx)  # warmup compiles
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = layer.forward(q, k, v, ctx)
    torch.cuda.synchronize()
    assert torch.equal(pool, snapshot)  # capture over a blanked slot_mapping wrote nothing

    gen = torch.Generator().manual_seed(5)
    q.copy_(torch.randn(q.shape, generator=gen))
    k.copy_(torch.randn(k.shape, generator=gen))
    v.copy_(torch.randn(v.shape, generator=gen))
    mgr.build_metadata(step_builder.fill(case.step_batch()))
    graph.replay()
    torch.cuda.synchronize()
    expected = snapshot.cpu()
    naive_store_kv(k.cpu(), v.cpu(), expected[0], expected[1], case.slot_mapping())
    assert torch.equal(pool.cpu(), expected)  # real slots written, padded rows nothing
    ref = naive_paged_attention(
        q.cpu(), expected[0], expected[1], case.block_table_tensor(rows),
        torch.arange(rows + 1, dtype=torch.int32), case.context_lens_tensor(rows), case.scale,
    )
    torch.testing.assert_close(out.cpu().float(), ref, **BF16_TOL)
