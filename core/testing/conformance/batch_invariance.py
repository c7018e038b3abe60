"""The ``batch_invariant`` promise, checked through the whole engine.

A backend that declares ``batch_invariant = True`` promises that, built with
``context.deterministic``, its layers give every token row the bits it would get
alone. The core makes everything else invariant in deterministic mode (products,
norms, the sampler), so the promise shows end to end: a probe request's tokens,
logprobs, top logprobs and prompt logprobs on a ``deterministic=True`` engine over
the kit's tiny model, with the backend serving its layer type, are bit for bit
those it gets alone, whatever mix of other requests it shares its steps with
(:mod:`.probes`).
"""

from __future__ import annotations

import atexit
import functools
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import attrs

from kvrunner.sampling_params import SamplingParams
from kvrunner.testing.conformance.errors import ConformanceError
from kvrunner.testing.conformance.probes import (
    BLOCK_SIZE,
    MAX_MODEL_LEN,
    MAX_SEQS,
    POOL,
    ProbeCase,
)
from kvrunner.testing.conformance.rig import FULL, Target

#: the tiny model for a backend of each layer type (a hybrid one for linear
#: attention, its full-attention layers served by ``paged``)
MODEL_KIND = {FULL: "qwen3", "linear_attention": "qwen3-next"}
#: what the probe is run alone on: one request a step, whole prompts, eager, sync
ALONE = dict(max_num_batched_tokens=256, async_scheduling=False, enforce_eager=True)


@functools.cache
def tiny_checkpoint(kind: str) -> Path:
    """The embedded tiny checkpoint of ``kind``, written once per process."""
    from kvrunner.models.tiny import write_tiny_checkpoint

    folder = Path(tempfile.mkdtemp(prefix="kvrunner-kit-"))
    atexit.register(shutil.rmtree, folder, ignore_errors=True)
    return write_tiny_checkpoint(folder / kind, kind=kind)


def engine_settings(target: Target) -> dict:
    """``LLM`` keyword arguments that put ``target`` in a deterministic tiny engine."""
    settings = dict(
        deterministic=True, dtype="float32", device=target.device, block_size=BLOCK_SIZE,
        max_num_seqs=MAX_SEQS, max_model_len=MAX_MODEL_LEN, num_blocks=POOL,
        **{target.layer_type: target.name},
    )  # fmt: skip
    if target.layer_type != FULL:
        settings[FULL] = "paged"
    if target.use_triton and target.device == "cpu":
        settings["triton_on_cpu"] = True
    if target.overlap is not None:
        # Cut every step it can, as the rig's overlap plugin does.
        settings.update(overlap=target.overlap, overlap_min_tokens=2, overlap_min_decode_seqs=2)
    return settings


@contextmanager
def engine(target: Target, **extra: object) -> Iterator[object]:
    """A deterministic ``LLM`` over the tiny model for ``target``; shut down after."""
    from kvrunner.llm import LLM

    llm = LLM(str(tiny_checkpoint(MODEL_KIND[target.layer_type])),
              **{**engine_settings(target), **extra})
    try:
        yield llm
    finally:
        llm.shutdown()


def _bits(values: object) -> object:
    """Floats as their exact hex (``-0.0`` and ``0.0`` differ, a NaN equals itself)."""
    if isinstance(values, float):
        return values.hex()
    if isinstance(values, dict):
        return {k: _bits(v) for k, v in values.items()}
    if isinstance(values, list | tuple):
        return [_bits(v) for v in values]
    return values


def outcome(out: object) -> dict[str, object]:
    """What the promise covers of one output, floats as bits."""
    return {name: _bits(getattr(out, name)) for name in
            ("token_ids", "logprobs", "top_logprobs", "prompt_logprobs", "prompt_top_logprobs")}


def _first_difference(alone: dict, mixed: dict) -> str:
    for name, want in alone.items():
        got = mixed[name]
        if got == want:
            continue
        if isinstance(want, list) and isinstance(got, list) and len(want) == len(got):
            at = next(i for i, (a, b) in enumerate(zip(want, got, strict=True)) if a != b)
            return f"{name}[{at}]: alone {want[at]}, in the mix {got[at]}"
        return f"{name}: alone {want}, in the mix {got}"
    raise AssertionError("no difference")  # pragma: no cover


@attrs.frozen
class MixSeen:
    """What the mixed engine did while serving the mix."""

    preemptions: int
    prefix_hit_tokens: int


def probe_bits_match_alone(target: Target, case: ProbeCase) -> MixSeen:
    """Of a backend declaring ``batch_invariant``: on ``deterministic=True`` engines, a
    probe request gets the same tokens, logprobs, top logprobs and prompt logprobs,
    bit for bit, in a mix of other requests (their number and lengths, its place,
    the chunk budget, a preemption, a prefix-cache hit, async steps, graphs, a
    sleep/wake first) as alone. Returns what the mixed engine did (preemptions and
    prefix hits, so a test can see a case exercise them)."""
    with engine(target, **ALONE) as alone_llm:
        alone = alone_llm.generate([case.probe], case.params)[0]
    prompts, params, at = case.requests()
    with engine(target, **case.mixed.settings()) as llm:
        if case.sleep_first:
            llm.sleep(1)
            llm.wake_up()
        if case.warm_prefix:  # the probe's prompt blocks in the prefix cache
            llm.generate([case.probe], SamplingParams(max_tokens=1))
        hits_before = llm.cache_info().prefix_hit_tokens
        mixed = llm.generate(prompts, params)[at]
        preempted = llm.engine.scheduler.num_preemptions
        hits = llm.cache_info().prefix_hit_tokens - hits_before
    want, got = outcome(alone), outcome(mixed)
    if got != want:
        raise ConformanceError(
            f"backend {target.name!r} declares batch_invariant, but with deterministic=True "
            f"the probe's outputs in a mix differ from its outputs alone: "
            f"{_first_difference(want, got)} (the mix: {len(prompts) - 1} other request(s), "
            f"the probe at index {at}, budget {case.mixed.budget} tokens a step, "
            f"{preempted} preemption(s), {hits} prefix-hit token(s))"
        )
    return MixSeen(preemptions=preempted, prefix_hit_tokens=hits)
