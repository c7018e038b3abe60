"""``kv_cache_dtype = "fp8"`` through whole engines: the pool holds twice the tokens of
bf16 at the same memory, greedy tokens stay close to full-precision KV's, the audits
read one-byte pools, and a backend that does not accept it is refused by name."""

from __future__ import annotations

import pytest
import torch

from kvrunner import LLM, SamplingParams
from kvrunner.config import CacheConfig
from kvrunner.errors import ConfigError
from kvrunner.plugin_api import BackendError
from kvrunner.testing.harness import backend_manager, small_model_spec
from kvrunner_paged.kv_format import FP8_DTYPE

#: the fraction of greedy tokens fp8 KV must generate before its first difference from
#: fp32 KV (after one, the two continue different texts): the tiny model's random
#: weights give near-ties that a rounding flips; measured 115 of 144 (0.80) on these
#: prompts, every sequence's first 10 tokens equal
AGREEMENT = 0.75
#: every sequence's first tokens agree
FIRST = 8


def _pool(kv_cache_dtype: str, dtype: str) -> tuple[int, int]:
    """``(blocks, pool bytes)`` of tiny-qwen3 in a fixed CPU budget."""
    with LLM("tiny-qwen3", device="cpu", dtype=dtype, cpu_cache_bytes=1 << 22,
             kv_cache_dtype=kv_cache_dtype) as llm:  # fmt: skip
        info = llm.cache_info()
        return info.num_blocks, info.ranks[0].pool_bytes["paged"]


@pytest.mark.parametrize(("dtype", "ratio"), [("bfloat16", 2), ("float32", 4)])
def test_the_pool_holds_more_tokens_in_the_same_memory(dtype: str, ratio: int) -> None:
    """One byte an element: twice bf16's blocks (four times fp32's) in the same budget,
    and the pool's bytes are what cache_spec promised."""
    blocks, pool_bytes = _pool("auto", dtype)
    fp8_blocks, fp8_bytes = _pool("fp8", dtype)
    assert fp8_blocks == ratio * blocks
    assert fp8_bytes == pool_bytes  # the same memory, spent on more tokens


def test_greedy_tokens_agree_with_full_precision_kv() -> None:
    """Greedy decoding of a batch (chunked prefill, decode steps), fp8 KV against fp32
    KV: each sequence's first :data:`FIRST` tokens equal, and at least
    :data:`AGREEMENT` of all tokens come before the sequence's first difference."""
    prompts = [list(range(3, 40)), [5, 6, 7], list(range(100, 160, 3)), [9] * 20,
               [11, 12, 13, 14], list(range(200, 230))]  # fmt: skip
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    settings = dict(device="cpu", max_num_seqs=8, block_size=8, num_blocks=64,
                    max_num_batched_tokens=32)  # fmt: skip
    with LLM("tiny-qwen3", **settings) as llm:
        full = [o.token_ids for o in llm.generate(prompts, params)]
    with LLM("tiny-qwen3", kv_cache_dtype="fp8", **settings) as llm:
        fp8 = [o.token_ids for o in llm.generate(prompts, params)]
    shared = []
    for f, q in zip(full, fp8, strict=True):
        assert f[:FIRST] == q[:FIRST]
        differ = [i for i, (a, b) in enumerate(zip(f, q, strict=True)) if a != b]
        shared.append(differ[0] if differ else len(f))
    assert sum(shared) / sum(len(f) for f in full) >= AGREEMENT


def test_the_audits_run_over_one_byte_pools() -> None:
    """Capture and step audits checksum FP8 pools (rows viewed as int8): no false alarm,
    and the tokens are the unaudited engine's."""
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    settings = dict(device="cpu", max_num_seqs=4, block_size=8, num_blocks=32,
                    kv_cache_dtype="fp8")  # fmt: skip
    with LLM("tiny-qwen3", audit=True, **settings) as llm:
        audited = [o.token_ids for o in llm.generate([[5, 6, 7], list(range(3, 30))], params)]
    with LLM("tiny-qwen3", **settings) as llm:
        plain = [o.token_ids for o in llm.generate([[5, 6, 7], list(range(3, 30))], params)]
    assert audited == plain


def test_vllms_name_is_the_same_format_and_others_are_refused() -> None:
    assert CacheConfig(kv_cache_dtype="fp8_e4m3").kv_cache_dtype == "fp8"
    with pytest.raises(ConfigError, match="kv_cache_dtype must be one of auto, fp8"):
        CacheConfig(kv_cache_dtype="fp8_e5m2")


def test_paged_stores_fp8_and_gdn_keeps_its_state_in_the_model_dtype() -> None:
    """A hybrid stack under fp8: paged's pools are e4m3, at half the bytes a block;
    gdn's recurrent and convolution state stays float32."""
    spec = small_model_spec(("full_attention", "linear_attention"))
    selection = {"full_attention": "paged", "linear_attention": "gdn"}
    specs = {}
    for kv in ("auto", "fp8"):
        manager = backend_manager(selection, spec, kv_cache_dtype=kv)
        specs[kv] = manager.cache_specs()
        pools = manager.allocate_cache(num_blocks=4, num_slots=3)
        kinds = {name: pool.dtype for name, pool in pools.items()}
        paged = {n: d for n, d in kinds.items() if n.startswith("paged.")}
        gdn = {n: d for n, d in kinds.items() if n.startswith("gdn.")}
        assert paged and gdn
        assert set(paged.values()) == {FP8_DTYPE if kv == "fp8" else torch.float32}
        assert set(gdn.values()) == {torch.float32}
    assert specs["fp8"]["paged"].bytes_per_block * 4 == specs["auto"]["paged"].bytes_per_block
    assert specs["fp8"]["gdn"] == specs["auto"]["gdn"]


def test_a_backend_that_does_not_accept_fp8_is_refused_by_name(flatkv_installed: str) -> None:
    """The fixture backend lists no kv_cache_dtypes: "auto" only."""
    with pytest.raises(BackendError, match=r"kv_cache_dtype='fp8' cannot run over backend "
                                           r"'flatkv'.*accepts \['auto'\]"):  # fmt: skip
        backend_manager({"full_attention": "flatkv"}, small_model_spec(), kv_cache_dtype="fp8")
