"""Every config field refuses bad values with a KvrunnerError naming the field.

The fields are discovered from the config classes themselves (``EngineConfig`` and
every section it holds), so a field added without a bad-value strategy here fails
with "add a bad-value strategy for X". Each strategy draws values a user could
write (wrong type, out of range, an unknown name); each must be refused by
``EngineConfig.load`` (or, for a check that needs the model or the installed
plugins, by ``LLM(...)`` before any weight loads), never by a traceback from deeper
code.
"""

from __future__ import annotations

import math

import attrs
import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvrunner import LLM
from kvrunner.config import ConfigError, EngineConfig
from kvrunner.errors import KvrunnerError


def config_classes() -> list[type]:
    """EngineConfig and every section class it holds (found from its fields)."""
    sections = [f.default.factory for f in attrs.fields(EngineConfig)
                if isinstance(f.default, attrs.Factory) and attrs.has(f.default.factory)]  # type: ignore[arg-type]
    return [EngineConfig, *sections]


def config_fields() -> list[str]:
    """Every settable field's flat name (sections themselves are not settable)."""
    sections = {c for c in config_classes() if c is not EngineConfig}
    return [f.name for c in config_classes() for f in attrs.fields(c)
            if not (isinstance(f.default, attrs.Factory) and f.default.factory in sections)]  # type: ignore[arg-type]


# Values of the wrong type for each kind of field. None is absent: an override of
# None means "not set" (the file's value, else the default).
not_a_number = st.sampled_from(["1", "", [1], {"a": 1}, True, False, b"1"])
not_an_int = not_a_number | st.floats(allow_nan=True, allow_infinity=True)
not_a_bool = st.sampled_from([0, 1, "true", "yes", "", [True], 1.0])
not_a_str = st.integers() | st.floats() | st.sampled_from([True, ["paged"], b"auto", {"x": 1}])


def ints_outside(lo: int, hi: int) -> st.SearchStrategy:
    return not_an_int | st.integers(max_value=lo - 1) | st.integers(min_value=hi + 1)


def floats_outside(lo: float, hi: float) -> st.SearchStrategy:
    return (not_a_number | st.sampled_from([math.nan, math.inf, -math.inf])
            | st.floats(max_value=lo, exclude_max=True, allow_nan=False)
            | st.floats(min_value=hi, exclude_min=True, allow_nan=False))


def strs_except(*valid: str) -> st.SearchStrategy:
    return not_a_str | st.text(max_size=12).filter(lambda s: s not in valid)


#: how each field is refused: at "load" (EngineConfig.load) or at "start" (LLM(...),
#: a check that needs the checkpoint or the installed plugins), with extra settings
BAD: dict[str, tuple[st.SearchStrategy, str, dict]] = {
    # top level
    "model": (not_a_str, "load", {}),
    "dtype": (strs_except("auto", "float32", "bfloat16", "float16"), "load", {}),
    "device": (strs_except("auto", "cpu") .filter(lambda s: not (isinstance(s, str)
               and s.startswith("cuda"))), "load", {}),
    "seed": (ints_outside(0, (1 << 63) - 1), "load", {}),
    "load_format": (strs_except("auto", "dummy"), "load", {}),
    "check_finite": (not_a_bool, "load", {}),
    "skip_tokenizer_init": (not_a_bool, "load", {}),
    "deterministic": (not_a_bool, "load", {}),
    "fp32_lm_head": (not_a_bool, "load", {}),
    "fp32_router_logits": (not_a_bool, "load", {}),
    "enable_return_routed_experts": (not_a_bool, "load", {}),
    "logprobs_mode": (strs_except("raw_logprobs", "raw_logits", "processed_logprobs",
                                  "processed_logits"), "load", {}),
    "generation_config": (strs_except("auto", "ignore"), "load", {}),
    "quantization": (strs_except("auto", "none", "fp8"), "load", {}),
    # [cache]
    "block_size": (ints_outside(1, 256), "load", {}),
    "gpu_memory_utilization": (floats_outside(0.01, 1.0), "load", {}),
    "cpu_cache_bytes": (ints_outside(1, 1 << 50), "load", {}),
    "num_blocks": (ints_outside(1, 1 << 40), "load", {}),
    "enable_prefix_caching": (not_a_bool, "load", {}),
    "kv_cache_dtype": (strs_except("auto", "fp8", "fp8_e4m3"), "load", {}),
    "calculate_kv_scales": (not_a_bool, "load", {}),
    "salt_prefix_cache_by_weight_version": (not_a_bool, "load", {}),
    # [scheduler]
    "max_num_seqs": (ints_outside(1, 1 << 16), "load", {}),
    "max_num_batched_tokens": (ints_outside(1, 1 << 24), "load", {}),
    "max_model_len": (ints_outside(2, 1 << 24), "load", {}),
    "enable_chunked_prefill": (not_a_bool, "load", {}),
    "async_scheduling": (not_a_bool, "load", {}),
    "nonfinite": (strs_except("error", "raise"), "load", {}),
    "max_logprobs": (ints_outside(0, 1 << 20), "load", {}),
    # [parallel]
    "tensor_parallel_size": (ints_outside(1, 1024), "load", {}),
    "distributed_backend": (strs_except("auto", "gloo", "nccl"), "load", {}),
    "distributed_timeout_s": (floats_outside(1, 1 << 20), "load", {}),
    "startup_timeout_s": (floats_outside(1, 1 << 20), "load", {}),
    "heartbeat_timeout_s": (floats_outside(0.5, 1 << 20), "load", {}),
    "distributed_executor": (strs_except("mp", "torchrun"), "load", {}),
    "all_reduce": (strs_except("auto", "nccl", "symm_mem"), "load", {}),
    # [capture]
    "enforce_eager": (not_a_bool, "load", {}),
    "capture_sizes": (
        st.sampled_from(["1,2", 4, [], [1.5], ["2"], [True]])
        | st.lists(st.integers(max_value=0), min_size=1, max_size=3)
        | st.lists(st.integers(65, 1 << 20), min_size=1, max_size=3),  # > max_num_seqs=64
        "load", {},
    ),
    "audit": (not_a_bool, "load", {}),
    "blank_write_targets": (not_a_bool, "load", {}),
    "decode_graph_ends_at": (strs_except("tokens", "logits", "hidden"), "load", {}),
    # [backends]
    "full_attention": (not_a_str, "load", {}),
    "linear_attention": (not_a_str, "load", {}),
    "overlap": (not_a_str, "load", {}),
    "overlap_min_tokens": (ints_outside(2, 1 << 24), "load", {}),
    "overlap_min_decode_seqs": (ints_outside(2, 1 << 16), "load", {}),
    # [kernels]
    "triton_on_cpu": (not_a_bool, "load", {}),
    "fused_sampler": (not_a_bool, "load", {}),
    "skinny_gemm": (strs_except("auto", "on", "off"), "load", {}),
    "gdn_prefill": (strs_except("auto", "ours", "fla"), "load", {}),
}

#: names only the installed plugins or the checkpoint can refuse: checked at start
AT_START: dict[str, tuple[st.SearchStrategy, dict]] = {
    "model": (st.sampled_from(["no-such-model", "", "/no/such/dir"]), {}),
    "full_attention": (st.sampled_from(["no-such-backend", "gdn", ""]), {}),
    "linear_attention": (st.sampled_from(["no-such-backend", "paged"]),
                         {"model": "tiny-qwen3-next"}),
    "overlap": (st.sampled_from(["no-such-plugin", "paged"]), {}),
    "enable_return_routed_experts": (st.just(True), {}),  # the dense default model
}


@pytest.mark.parametrize("name", config_fields())
def test_every_config_field_refuses_bad_values_naming_it(name: str) -> None:
    if name not in BAD:
        pytest.fail(f"add a bad-value strategy for {name}")
    strategy, _, extra = BAD[name]

    @given(bad=strategy)
    def refused(bad: object) -> None:
        with pytest.raises(ConfigError) as e:
            EngineConfig.load(**extra, **{name: bad})
        assert name in str(e.value), f"{name}={bad!r} refused without naming it: {e.value}"

    refused()


@pytest.mark.parametrize("name", sorted(AT_START))
def test_names_only_the_start_can_check_are_refused_before_loading(name: str) -> None:
    strategy, extra = AT_START[name]

    @given(bad=strategy)
    def refused(bad: object) -> None:
        with pytest.raises(KvrunnerError) as e:
            LLM(enforce_eager=True, **extra, **{name: bad})
        assert name in str(e.value), f"{name}={bad!r}: {e.value}"

    refused()


def test_every_strategy_belongs_to_a_field() -> None:
    """A strategy left for a field that no longer exists is dead: remove it."""
    assert set(BAD) <= set(config_fields())
    assert set(AT_START) <= set(BAD)


def test_a_capture_size_above_max_num_seqs_is_refused_naming_it() -> None:
    """No decode step is larger than max_num_seqs: that graph would never replay."""
    with pytest.raises(ConfigError, match=r"capture_sizes \[128\] exceed max_num_seqs=64"):
        LLM(capture_sizes=[1, 8, 128], max_num_seqs=64)
    with pytest.raises(ConfigError, match=r"capture_sizes \[8\] exceed max_num_seqs=4"):
        EngineConfig.load(capture_sizes=[1, 8], max_num_seqs=4)


@pytest.mark.parametrize("sizes", [[0], [4, -1], []])
def test_a_capture_size_below_one_from_python_is_a_config_error(sizes) -> None:
    with pytest.raises(ConfigError, match="capture_sizes"):
        LLM(capture_sizes=sizes)


def test_a_pool_of_no_blocks_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="num_blocks"):
        LLM(num_blocks=0)
