"""Engine configuration: frozen, validated attrs classes.

Loaded from a TOML file (sections match the classes), then overridden by keyword
arguments or CLI flags. Overrides use flat names (``block_size=32``), as vLLM's
``LLM(...)`` does; every flat name belongs to exactly one section.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import attrs

from kvrunner.config_checks import (
    KV_CACHE_DTYPES,
    canonical_kv_cache_dtype,
    capture_sizes_tuple,
    check_capture_sizes,
    check_device,
    check_number,
    check_type,
    misplaced_section_key,
    misplaced_top_key,
    read_toml,
)
from kvrunner.errors import ConfigError


def _in_range(lo: float, hi: float):
    def check(instance: object, attribute: attrs.Attribute, value: float) -> None:
        check_number(f"{type(instance).__name__}.{attribute.name}", value, lo, hi)

    return check


def _one_of(*choices: str):
    def check(instance: object, attribute: attrs.Attribute, value: str) -> None:
        if value not in choices:
            raise ConfigError(
                f"{type(instance).__name__}.{attribute.name} must be one of "
                f"{', '.join(choices)}; got {value!r}"
            )

    check.choices = choices  # type: ignore[attr-defined]  # the CLI lists them
    return check


#: what a token's logprob is (vLLM's ``logprobs_mode``, the default first):
#: ``layers/logprobs_mode.py``
LOGPROBS_MODES: tuple[str, ...] = (
    "raw_logprobs", "raw_logits", "processed_logprobs", "processed_logits",
)  # fmt: skip


@attrs.frozen(kw_only=True)
class CacheConfig:
    block_size: int = attrs.field(default=16, validator=_in_range(1, 256))
    gpu_memory_utilization: float = attrs.field(default=0.9, validator=_in_range(0.01, 1.0))
    #: memory budget for all cache pools on the CPU (no device to measure)
    cpu_cache_bytes: int = attrs.field(default=256 << 20, validator=_in_range(1, 1 << 50))
    #: fixed block count; skips sizing (tests, reproducible runs)
    num_blocks: int | None = attrs.field(
        default=None, validator=attrs.validators.optional(_in_range(1, 1 << 40))
    )
    enable_prefix_caching: bool = True
    #: how full-attention keys and values are stored: "auto" in the model's dtype,
    #: "fp8" (vLLM's "fp8_e4m3" is the same) one byte an element, float8 e4m3 with a
    #: per-tensor scale, as vLLM's ``--kv-cache-dtype``; a backend serving layers of
    #: the engine must accept it (``kv_cache_dtypes`` on its factory, docs/plugins.md)
    kv_cache_dtype: str = attrs.field(
        default="auto", converter=canonical_kv_cache_dtype,
        validator=_one_of(*KV_CACHE_DTYPES),
    )
    #: with ``kv_cache_dtype = "fp8"``: each full-attention layer sets its key and value
    #: scales from its first real prefill (``amax / 200`` and ``amax / 100``, vLLM's
    #: ``calculate_kv_scales``) unless the checkpoint brought ``k_scale`` / ``v_scale``;
    #: off, scales a checkpoint does not bring stay 1.0
    calculate_kv_scales: bool = False
    #: salt every request's prefix-cache hashes with the weight version it is admitted
    #: under, so KV computed under other weights is never reused (even where a weight
    #: update keeps the prefix cache: SGLang's ``flush_cache: false``)
    salt_prefix_cache_by_weight_version: bool = True


@attrs.frozen(kw_only=True)
class SchedulerConfig:
    max_num_seqs: int = attrs.field(default=64, validator=_in_range(1, 1 << 16))
    #: tokens one step may carry; None: by device, as vLLM's ``LLM`` chooses (16,384 on
    #: a GPU of 70 GiB or more, 8,192 on a smaller one, 2,048 on the CPU), resolved by
    #: the ranks when they start (``kvrunner.runner.setup.default_batched_tokens``)
    max_num_batched_tokens: int | None = attrs.field(
        default=None, validator=attrs.validators.optional(_in_range(1, 1 << 24))
    )
    #: tokens per sequence, prompt and output together; None: the model's
    #: max_position_embeddings, capped by what the KV pool holds, resolved by the ranks
    #: when they size the pool (``kvrunner.runner.model_len``) and printed at start
    max_model_len: int | None = attrs.field(
        default=None, validator=attrs.validators.optional(_in_range(2, 1 << 24))
    )
    enable_chunked_prefill: bool = True
    #: schedule step N+1 while step N runs; sampled tokens stay on the device and
    #: the host learns them one step later (false: strictly alternating steps)
    async_scheduling: bool = True
    #: a request whose logits row is non-finite ends with finish reason "error";
    #: "raise" also makes that step raise NonFiniteLogitsError (the call's other
    #: requests are aborted, the engine stays usable)
    nonfinite: str = attrs.field(default="error", validator=_one_of("error", "raise"))
    #: the most top logprobs a request may ask for (SamplingParams.logprobs), as vLLM's
    #: max_logprobs: each costs a top-k over the vocabulary and a host copy per token
    max_logprobs: int = attrs.field(default=20, validator=_in_range(0, 1 << 20))


@attrs.frozen(kw_only=True)
class ParallelConfig:
    tensor_parallel_size: int = attrs.field(default=1, validator=_in_range(1, 1024))
    #: torch.distributed backend: "auto" is NCCL on CUDA, gloo on the CPU
    distributed_backend: str = attrs.field(
        default="auto", validator=_one_of("auto", "gloo", "nccl")
    )
    #: seconds any collective, or the driver's wait for a rank's answer to a step,
    #: may take before it fails (also bounds a rank waiting for a slower one to load)
    distributed_timeout_s: float = attrs.field(default=600.0, validator=_in_range(1, 1 << 20))
    #: seconds a spawned rank may go without a heartbeat (a thread on the rank beats
    #: while it runs, whatever it computes) before the driver names it as stopped
    #: or frozen; the collectives' own bound is distributed_timeout_s
    heartbeat_timeout_s: float = attrs.field(default=10.0, validator=_in_range(0.5, 1 << 20))
    #: seconds the driver waits for every rank to load, size its pools and capture
    startup_timeout_s: float = attrs.field(default=3600.0, validator=_in_range(1, 1 << 20))
    #: how ranks > 0 are run: "mp" spawns one process per rank from the driver;
    #: "torchrun" means every rank was launched externally (kvrunner.launch)
    distributed_executor: str = attrs.field(
        default="mp", validator=_one_of("mp", "torchrun")
    )
    #: the layers' all-reduce: "auto" sends decode-sized tensors through torch
    #: symmetric memory where every rank can (CUDA, one host), NCCL otherwise;
    #: "nccl" never uses symmetric memory; "symm_mem" fails start-up if unavailable
    all_reduce: str = attrs.field(
        default="auto", validator=_one_of("auto", "nccl", "symm_mem")
    )


@attrs.frozen(kw_only=True)
class CaptureConfig:
    #: run every step eagerly (no graphs on CUDA, no capture pass on CPU)
    enforce_eager: bool = False
    #: batch sizes to capture; default 1, 2, 4, 8, then steps of 16 up to max_num_seqs
    #: (each at most max_num_seqs: checked by EngineConfig, see check_capture_sizes)
    capture_sizes: tuple[int, ...] | None = attrs.field(
        default=None, converter=capture_sizes_tuple
    )
    #: audit every capture (no pool byte changes) and every step (only its own slots
    #: change, the core's step buffers stay as filled): runner/step/step_audit.py
    audit: bool = False
    #: blank every declared write target before capture (off only to prove tests fail)
    blank_write_targets: bool = True
    #: where a decode graph ends: "tokens" (the logits and the sampler's common rows
    #: captured too), "logits", or "hidden" (the forward alone; logits and sampling
    #: eager), to measure what each part saves (``runner/capture/graph_sampling.py``)
    decode_graph_ends_at: str = attrs.field(
        default="tokens", validator=_one_of("tokens", "logits", "hidden")
    )


@attrs.frozen(kw_only=True)
class KernelsConfig:
    """Which kernel runs an op where more than one serves it. Every choice computes the
    same thing (the torch path is the reference each kernel is tested against); the
    defaults are the ones measured fastest (docs/benchmarks.md)."""

    #: run the Triton kernels on CPU tensors too (under TRITON_INTERPRET=1): the
    #: kernels' path without a GPU, for tests; CUDA tensors take them regardless
    triton_on_cpu: bool = False
    #: seeded, unfiltered sampling rows on the Triton path are drawn in one pass over
    #: their logits (``layers/fused/gumbel_argmax_triton.py``); off: the torch path
    fused_sampler: bool = True
    #: decode-sized projections through the skinny-GEMM kernel: "auto" one-row products
    #: (where it beat cuBLAS), "on" every product of at most 64 rows, "off" never
    skinny_gemm: str = attrs.field(default="auto", validator=_one_of("auto", "on", "off"))
    #: the gdn backend's chunked prefill: "auto" fla's kernel where it imports and
    #: serves the layer at our accuracy, else ours; "ours" never fla; "fla" fla wherever
    #: it can run at all (an error where it cannot)
    gdn_prefill: str = attrs.field(default="auto", validator=_one_of("auto", "ours", "fla"))

    def options_for(self, backend: str) -> dict[str, str]:
        """The choices addressed to one backend: each field ``<backend>_<option>`` as
        ``{option: value}`` (``gdn_prefill`` reaches the gdn backend as ``prefill``)."""
        prefix = f"{backend}_"
        return {f.name.removeprefix(prefix): getattr(self, f.name)
                for f in attrs.fields(KernelsConfig) if f.name.startswith(prefix)}


@attrs.frozen(kw_only=True)
class BackendsConfig:
    """Which backend serves each layer type (``full_attention = "paged"``), and the
    overlap plugin on top of them (``overlap = "tbo"``; ``"none"``: no plugin)."""

    full_attention: str = "paged"
    linear_attention: str = "gdn"
    overlap: str = "none"
    #: prefill / mixed steps of fewer tokens run unsplit (the split would not pay)
    overlap_min_tokens: int = attrs.field(default=1024, validator=_in_range(2, 1 << 24))
    #: decode steps and graphs of fewer sequences run unsplit
    overlap_min_decode_seqs: int = attrs.field(default=64, validator=_in_range(2, 1 << 16))

    def for_layer_type(self, layer_type: str) -> str:
        layer_types = [f.name for f in attrs.fields(BackendsConfig)
                       if not f.name.startswith("overlap")]
        if layer_type not in layer_types:
            raise ConfigError(
                f"no backend setting for layer type {layer_type!r} "
                f"(known: {', '.join(layer_types)})"
            )
        return getattr(self, layer_type)


_SECTIONS: dict[str, type] = {
    "cache": CacheConfig,
    "scheduler": SchedulerConfig,
    "parallel": ParallelConfig,
    "capture": CaptureConfig,
    "backends": BackendsConfig,
    "kernels": KernelsConfig,
}


@attrs.frozen(kw_only=True)
class EngineConfig:
    model: str = "tiny-qwen3"
    dtype: str = attrs.field(
        default="auto", validator=_one_of("auto", "float32", "bfloat16", "float16")
    )
    device: str = attrs.field(default="auto", validator=lambda _i, _a, v: check_device(v))
    seed: int = attrs.field(default=0, validator=_in_range(0, (1 << 63) - 1))
    #: "auto" reads the checkpoint's safetensors; "dummy" starts from config.json alone
    #: with small random weights, for a trainer that pushes the real ones (update_weights)
    load_format: str = attrs.field(default="auto", validator=_one_of("auto", "dummy"))
    #: refuse a checkpoint holding NaN or inf at start-up, naming the tensor (one
    #: min/max pass over each tensor as it is read); load_weights checks the same
    #: (its own check_finite argument)
    check_finite: bool = True
    #: load no tokenizer even if the checkpoint has one: prompts must be token ids
    skip_tokenizer_init: bool = False
    #: "auto": a request made without SamplingParams samples with the checkpoint's
    #: generation_config.json (temperature, top_p, top_k), as vLLM's does;
    #: "ignore": with SamplingParams()' own defaults
    generation_config: str = attrs.field(default="auto", validator=_one_of("auto", "ignore"))
    #: batch-invariant kernels: a request's tokens and logprobs are bit for bit the same
    #: whatever else shares its steps (at one tensor-parallel size); refused at start
    #: where a backend does not declare ``batch_invariant`` (docs/determinism.md)
    deterministic: bool = False
    #: the LM head's product in float32 (SGLang's ``--enable-fp32-lm-head``): the
    #: logits, logprobs and draws see no bf16 rounding of the product
    #: (``layers/numerics.py``)
    fp32_lm_head: bool = False
    #: MoE routers' logits in float32, so near-tie experts are chosen as a float32
    #: trainer chooses them (``layers/numerics.py``)
    fp32_router_logits: bool = False
    #: what the returned logprobs are, as vLLM's ``--logprobs-mode``: raw_logprobs
    #: (the model's, before the request's sampling settings), raw_logits, or
    #: processed_logprobs / processed_logits (after the logit adjustments, temperature,
    #: min_p, top-k and top-p, renormalised over the kept tokens): layers/logprobs_mode.py
    logprobs_mode: str = attrs.field(default="raw_logprobs", validator=_one_of(*LOGPROBS_MODES))
    #: record the experts every mixture-of-experts layer routes each token to, per KV
    #: slot, so requests may ask for them (``SamplingParams.return_routed_experts``);
    #: refused at start for a model without sparse layers
    enable_return_routed_experts: bool = False
    #: the dense projections' and MoE experts' weights: "fp8" stores them as FP8 e4m3 with
    #: 128 x 128 block scales (an FP8 checkpoint loads as stored, a bf16 one and every
    #: push are quantized as they load); "auto" follows the checkpoint's
    #: quantization_config; "none" keeps the model dtype (``layers/fp8/``)
    quantization: str = attrs.field(default="auto", validator=_one_of("auto", "none", "fp8"))
    cache: CacheConfig = attrs.field(factory=CacheConfig)
    scheduler: SchedulerConfig = attrs.field(factory=SchedulerConfig)
    parallel: ParallelConfig = attrs.field(factory=ParallelConfig)
    capture: CaptureConfig = attrs.field(factory=CaptureConfig)
    backends: BackendsConfig = attrs.field(factory=BackendsConfig)
    kernels: KernelsConfig = attrs.field(factory=KernelsConfig)

    def __attrs_post_init__(self) -> None:
        check_capture_sizes(self.capture.capture_sizes, max_num_seqs=self.scheduler.max_num_seqs)

    @classmethod
    def load(cls, path: str | Path | None = None, **overrides: Any) -> EngineConfig:
        """Build a config from an optional TOML file, then flat keyword overrides."""
        sections: dict[str, dict[str, Any]] = {name: {} for name in _SECTIONS}
        top: dict[str, Any] = {}
        if path is not None:
            for key, value in read_toml(path).items():
                if key in _SECTIONS:
                    if not isinstance(value, Mapping):
                        raise ConfigError(f"{path}: [{key}] must be a table")
                    sections[key].update(value)
                elif key in _TOP_KEYS:
                    top[key] = value
                else:
                    where = misplaced_top_key(key, value, sections=_SECTIONS,
                                              flat_keys=_FLAT_KEYS, top_keys=_TOP_KEYS)
                    raise ConfigError(f"{path}: {where}")
        for key, value in overrides.items():
            if value is None:
                continue
            section = _FLAT_KEYS.get(key)
            if section is None and key not in _TOP_KEYS:
                raise ConfigError(f"unknown config key {key!r}; valid keys: {sorted(_ALL_KEYS)}")
            if section is None:
                top[key] = value
            else:
                sections[section][key] = value
        unknown = set(top) - _TOP_KEYS
        if unknown:
            raise ConfigError(
                f"unknown config key(s) {sorted(unknown)}; valid: {sorted(_ALL_KEYS)}"
            )
        for field in attrs.fields(cls):
            if field.name in top:
                check_type("", field.name, field.type, top[field.name])
        built = {}
        for name, klass in _SECTIONS.items():
            fields = {f.name: f for f in attrs.fields(klass)}
            for key, value in sections[name].items():
                if key not in fields:
                    raise ConfigError(misplaced_section_key(
                        name, key, valid=fields, flat_keys=_FLAT_KEYS, top_keys=_TOP_KEYS
                    ))
                check_type(f"[{name}]", key, fields[key].type, value)
            try:
                built[name] = klass(**sections[name])
            except TypeError as e:
                raise ConfigError(f"[{name}]: {e}") from None
        return cls(**top, **built)


_TOP_KEYS = {f.name for f in attrs.fields(EngineConfig)} - set(_SECTIONS)
_FLAT_KEYS = {f.name: s for s, k in _SECTIONS.items() for f in attrs.fields(k)}
_ALL_KEYS = _TOP_KEYS | set(_FLAT_KEYS)
assert not (_TOP_KEYS & set(_FLAT_KEYS)), "flat config names must be unique"
