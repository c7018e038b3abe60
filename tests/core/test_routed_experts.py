"""Routed experts (``return_routed_experts``): every computed token's top-k expert ids
per layer are the ones transformers' router picks on the same weights and tokens.

Tiny random Qwen3-MoE (a dense layer among sparse ones) and sparse Qwen3-Next
checkpoints written by transformers; the oracle is transformers' forward over the
prompt and the output with ``output_router_logits``, top-k of the router softmax.
Held however the engine schedules the tokens: eagerly, through captured decode
graphs (the CPU's stand-in; real CUDA graphs under the ``gpu`` marker) with the
capture and step audits on, in chunks, with asynchronous steps off, cut into two
micro-batches, after a preemption, across a sleep and wake, on two ranks, and when
the prompt's blocks come from the prefix cache (a group's later samples, and a later
request sharing the prefix), where a fresh engine is the second oracle. A capture
after serving leaves the routes pool as it was, and the write itself skips PAD rows.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import assume, given
from hypothesis import strategies as st

from kvrunner import LLM, SamplingParams
from kvrunner.config import ConfigError
from kvrunner.errors import RequestError
from kvrunner.layers.expert_routes import write_routes
from kvrunner.plugin_api import BackendError
from kvrunner.testing.moe_checkpoints import save_hf_qwen3_moe, save_hf_qwen3_next_moe

transformers = pytest.importorskip("transformers")

#: one token alone, a chunk of many, and (the last) three full blocks of 4 and one more
PROMPTS = [[11, 250, 37], [9, 8, 7, 6, 5, 4, 3, 2, 1], [300],
           [21, 43, 65, 87, 109, 131, 153, 175, 197, 219, 241, 263, 285]]
NEW_TOKENS = 6
ROUTED = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True,
                        return_routed_experts=True)
BASE = dict(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=64, num_blocks=64,
            block_size=4, enable_return_routed_experts=True)  # fmt: skip

MODELS = {
    "qwen3-moe-dense0-top2": (save_hf_qwen3_moe, dict(
        num_experts=5, num_experts_per_tok=2, mlp_only_layers=[0], num_hidden_layers=3)),
    "next-moe-7e-top3": (save_hf_qwen3_next_moe, dict(
        num_experts=7, num_experts_per_tok=3, norm_topk_prob=False)),
}  # fmt: skip


class Oracle:
    """A transformers MoE model and the routes its router picks."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        config = model.config
        self.top_k = config.num_experts_per_tok
        self.num_layers = config.num_hidden_layers
        self.sparse = [i for i, layer in enumerate(model.model.layers)
                       if hasattr(layer.mlp, "experts")]

    def routes(self, tokens: list[int]) -> np.ndarray:
        """``[len(tokens), layers, top_k]``: each token's experts, -1 in dense layers."""
        with torch.no_grad():
            out = self.model(torch.tensor([tokens]), output_router_logits=True, use_cache=False)
        full = np.full((len(tokens), self.num_layers, self.top_k), -1, np.int32)
        assert len(out.router_logits) == len(self.sparse)
        for layer, logits in zip(self.sparse, out.router_logits, strict=True):
            probs = torch.softmax(logits.reshape(len(tokens), -1).float(), dim=-1)
            full[:, layer] = probs.topk(self.top_k, dim=-1).indices.numpy()
        return full


@pytest.fixture(scope="module", params=list(MODELS), ids=list(MODELS))
def case(request, tmp_path_factory) -> tuple[str, Oracle]:
    writer, overrides = MODELS[request.param]
    path = tmp_path_factory.mktemp("hf") / request.param
    return str(path), Oracle(writer(path, seed=1, **overrides))


def expect_transformers_routes(oracle: Oracle, outputs) -> None:
    """Each output's routes are the oracle's over its prompt and all but its last token."""
    for out in outputs:
        tokens = [*out.prompt_token_ids, *out.token_ids][:-1]
        assert out.routed_experts is not None
        assert out.routed_experts.dtype == np.int32
        assert out.routed_experts.shape == (len(tokens), oracle.num_layers, oracle.top_k)
        np.testing.assert_array_equal(out.routed_experts, oracle.routes(tokens))


SETTINGS = {
    "eager": {"enforce_eager": True},
    "graphs-audited": {"audit": True},  # the CPU stand-in replays; both audits check
    "chunked": {"max_num_batched_tokens": 8, "max_num_seqs": 3},
    "sync-steps": {"async_scheduling": False},
    "tbo": {"overlap": "tbo", "overlap_min_tokens": 2, "overlap_min_decode_seqs": 2,
            "capture_sizes": (2, 4)},
    "preempting": {"num_blocks": 6, "enforce_eager": True},
}


@pytest.mark.parametrize("settings", list(SETTINGS.values()), ids=list(SETTINGS))
def test_routes_are_transformers_router_choices(case, settings) -> None:
    path, oracle = case
    llm = LLM(path, **(BASE | settings))
    try:
        outs = llm.generate(PROMPTS, ROUTED)
        if "num_blocks" in settings:
            assert llm.engine.scheduler.num_preemptions > 0, "precondition: a preemption"
    finally:
        llm.shutdown()
    expect_transformers_routes(oracle, outs)


# A hybrid model caches no prefix (its recurrent state after one is not kept), so the
# Qwen3-MoE case alone holds this.
@pytest.mark.parametrize("case", ["qwen3-moe-dense0-top2"], indirect=True)
def test_prefix_cache_hits_return_the_cached_blocks_routes(case) -> None:
    """A group's later samples and a later request sharing the prompt reuse its full
    blocks; their routes for those positions come from the cache and equal a fresh
    engine's (and transformers')."""
    path, oracle = case
    shared = PROMPTS[3]  # 13 tokens: 3 full blocks of 4
    later = [*shared, 40, 41, 42, 43, 44]
    group = SamplingParams(max_tokens=NEW_TOKENS, temperature=1.0, seed=3, n=3,
                           ignore_eos=True, return_routed_experts=True)
    llm = LLM(path, **BASE)
    try:
        first = llm.generate([shared], group)
        hits = llm.cache_info().prefix_hit_tokens
        second = llm.generate([later], ROUTED)
        assert hits >= 2 * 12 and llm.cache_info().prefix_hit_tokens >= hits + 12, (
            "precondition: the later samples and the later request hit the cache")
    finally:
        llm.shutdown()
    fresh = LLM(path, **(BASE | {"enable_prefix_caching": False}))
    try:
        alone = fresh.generate([later], ROUTED)
    finally:
        fresh.shutdown()
    assert second[0].token_ids == alone[0].token_ids
    np.testing.assert_array_equal(second[0].routed_experts, alone[0].routed_experts)
    expect_transformers_routes(oracle, [*first, *second])


def test_a_request_that_asks_for_none_gets_none_and_others_are_unchanged(case) -> None:
    path, oracle = case
    llm = LLM(path, **BASE)
    try:
        plain = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
        outs = llm.generate(PROMPTS[:2], [plain, ROUTED])
    finally:
        llm.shutdown()
    assert outs[0].routed_experts is None
    expect_transformers_routes(oracle, outs[1:])


def test_a_request_for_routes_is_refused_without_the_engine_option(case) -> None:
    path, _ = case
    llm = LLM(path, **(BASE | {"enable_return_routed_experts": False}))
    try:
        with pytest.raises(RequestError, match="enable_return_routed_experts"):
            llm.generate(PROMPTS[:1], ROUTED)
        assert llm.generate(PROMPTS[:1], SamplingParams(max_tokens=2))[0].token_ids
    finally:
        llm.shutdown()


def test_a_dense_model_refuses_the_engine_option() -> None:
    with pytest.raises(ConfigError, match="no mixture-of-experts layer"):
        LLM("tiny-qwen3", enable_return_routed_experts=True)


def test_the_routes_pool_is_counted_in_the_pool_sizing(case) -> None:
    """Per block: every sparse layer's top-k int32 ids for each of its slots."""
    path, oracle = case
    llm = LLM(path, **(BASE | {"enforce_eager": True}))
    try:
        runner = llm.executor.runner
        specs = runner.backends.cache_specs()
        pools = runner.cache.pools
    finally:
        llm.shutdown()
    per_block = len(oracle.sparse) * oracle.top_k * 4 * BASE["block_size"]
    assert specs["routed_experts"].bytes_per_block == per_block
    assert pools["routed_experts.routes"].numel() * 4 == per_block * BASE["num_blocks"]


@pytest.mark.parametrize("settings", [{"enforce_eager": True}, {}], ids=["eager", "graphs"])
def test_two_ranks_return_the_routes_of_one(tmp_path: Path, settings) -> None:
    oracle = Oracle(save_hf_qwen3_moe(tmp_path, seed=2, num_experts=5, num_experts_per_tok=2))
    llm = LLM(str(tmp_path), **(BASE | settings | {"tensor_parallel_size": 2}))
    try:
        outs = llm.generate(PROMPTS, ROUTED)
    finally:
        llm.shutdown()
    expect_transformers_routes(oracle, outs)


def test_a_sleep_and_wake_keep_recording_routes(case) -> None:
    """The routes pool is released and allocated again with the KV pool."""
    path, oracle = case
    llm = LLM(path, **BASE)
    try:
        before = llm.generate(PROMPTS[:2], ROUTED)
        llm.sleep(1)
        assert "routed_experts.routes" not in llm.executor.runner.cache.pools
        llm.wake_up()
        after = llm.generate(PROMPTS[2:], ROUTED)
    finally:
        llm.shutdown()
    expect_transformers_routes(oracle, [*before, *after])


def test_a_recapture_after_serving_writes_no_route(case) -> None:
    """Capturing runs the model over every row, but through a slot mapping at PAD: the
    routes pool holds the served requests' routes, byte for byte, afterwards."""
    path, _ = case
    llm = LLM(path, **BASE)
    try:
        llm.generate(PROMPTS, ROUTED)
        pool = llm.executor.runner.cache.pools["routed_experts.routes"]
        served = pool.clone()
        assert served.any(), "precondition: serving recorded routes"
        llm.recapture()
        assert torch.equal(pool, served)
    finally:
        llm.shutdown()


@given(slots=st.lists(st.integers(-1, 7), min_size=1, max_size=12), seed=st.integers(0, 99))
def test_padded_rows_write_nothing_and_real_rows_land_at_their_slots(slots, seed) -> None:
    """``write_routes``: every row whose slot is >= 0 writes its ids there, a row at PAD
    (-1) writes nothing, whichever slots the other rows name (slot 0 included)."""
    real = [s for s in slots if s >= 0]
    assume(len(set(real)) == len(real))  # a step's real slots are distinct
    gen = torch.Generator().manual_seed(seed)
    rows = torch.randint(0, 9, (8, 3), generator=gen, dtype=torch.int32)
    ids = torch.randint(0, 9, (len(slots), 3), generator=gen, dtype=torch.int64)
    want = rows.clone()
    for t, s in enumerate(slots):
        if s >= 0:
            want[s] = ids[t].to(torch.int32)
    write_routes(rows, torch.tensor(slots), ids)
    assert torch.equal(rows, want)


@pytest.mark.gpu
@pytest.mark.parametrize("settings", [{"enforce_eager": True}, {}, {"overlap": "tbo"}],
                         ids=["eager", "cuda-graphs", "tbo-graphs"])
def test_routes_on_cuda_are_transformers_router_choices(tmp_path: Path, settings) -> None:
    """On CUDA: the Triton router and grouped experts, real decode graphs (replayed with
    a padded tail), two streams under TBO; float32, so transformers' router decides the
    same experts."""
    oracle = Oracle(save_hf_qwen3_moe(tmp_path, seed=1, num_experts=5, num_experts_per_tok=2,
                                      mlp_only_layers=[0], num_hidden_layers=3))
    llm = LLM(str(tmp_path), device="cuda", dtype="float32",
              **(BASE | {"capture_sizes": (1, 2, 4)} | settings))
    try:
        outs = llm.generate(PROMPTS[:3], ROUTED)  # three rows: a graph of 4 pads one
    finally:
        llm.shutdown()
    expect_transformers_routes(oracle, outs)


def test_a_layer_type_cannot_select_the_core_s_routes_backend() -> None:
    with pytest.raises(BackendError, match="'routed_experts'.*the core's own"):
        LLM("tiny-qwen3-moe", enable_return_routed_experts=True,
            full_attention="routed_experts")
