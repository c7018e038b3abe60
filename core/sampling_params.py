"""Per-request sampling settings, shaped like vLLM's ``SamplingParams``.

Every field is checked when the object is built, so a bad value is refused before
any model work with a :class:`~kvrunner.errors.RequestError` (a ``ValueError``)
naming the field: a ``max_tokens`` of 2.5 or ``"5"`` is not silently rounded or
left to fail later, and a NaN temperature never reaches the sampler.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Mapping
from numbers import Integral, Real
from typing import Any

import attrs

from kvrunner.errors import RequestError
from kvrunner.structured_outputs import StructuredOutputsParams


def is_int(value: Any) -> bool:
    """A real integer: ``int`` or numpy's, but not ``bool`` and not a whole float."""
    return isinstance(value, Integral) and not isinstance(value, bool)


def int64_seed(seed: int) -> int:
    """The int64 key a request's ``seed`` draws its noise with: ``seed`` itself where it
    fits an int64, else a 63-bit BLAKE2b digest of it."""
    if -(2**63) <= seed < 2**63:
        return seed
    digest = hashlib.blake2b(str(seed).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


def _describe(value: Any) -> str:
    return f"{value!r} ({type(value).__name__})"


def _int_field(*, minimum: int | None = None, optional: bool = False):
    def check(_instance: object, attribute: attrs.Attribute, value: Any) -> None:
        if optional and value is None:
            return
        name = f"SamplingParams.{attribute.name}"
        if not is_int(value):
            raise RequestError(f"{name} must be an integer, got {_describe(value)}")
        if minimum is not None and value < minimum:
            raise RequestError(f"{name} must be >= {minimum}, got {value}")

    return check


def _finite(_instance: object, attribute: attrs.Attribute, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, Real) or not math.isfinite(value):
        raise RequestError(
            f"SamplingParams.{attribute.name} must be a finite number, got {_describe(value)}"
        )


def _bool(_instance: object, attribute: attrs.Attribute, value: Any) -> None:
    if not isinstance(value, bool):
        raise RequestError(
            f"SamplingParams.{attribute.name} must be True or False, got {_describe(value)}"
        )


def _is_list_like(value: Any) -> bool:
    """A sequence of values: iterable, but not text, bytes or a mapping (whose keys
    alone would be taken)."""
    return hasattr(value, "__iter__") and not isinstance(value, str | bytes | Mapping)


def _token_ids(value: Any) -> tuple[Any, ...]:
    if value is None:  # as vLLM takes it: none
        return ()
    if not _is_list_like(value):
        raise RequestError(
            f"SamplingParams.stop_token_ids must be a list of token ids, got {_describe(value)}"
        )
    ids = tuple(value)
    bad = [t for t in ids if not is_int(t) or t < 0]
    if bad:
        raise RequestError(
            f"SamplingParams.stop_token_ids must hold non-negative integers, got {bad[:5]}"
        )
    return ids


def _optional_token_ids(value: Any) -> tuple[Any, ...] | None:
    if value is None:  # every token allowed
        return None
    if not _is_list_like(value):
        raise RequestError(
            f"SamplingParams.allowed_token_ids must be a list of token ids, got {_describe(value)}"
        )
    ids = tuple(value)
    bad = [t for t in ids if not is_int(t) or t < 0]
    if bad:
        raise RequestError(
            f"SamplingParams.allowed_token_ids must hold non-negative integers, got {bad[:5]}"
        )
    if not ids:  # an empty list would leave nothing to sample
        raise RequestError("SamplingParams.allowed_token_ids must not be empty")
    return tuple(sorted(set(ids)))


def _logit_bias(value: Any) -> tuple[tuple[int, float], ...]:
    if value is None:  # as vLLM takes it: none
        return ()
    pairs = value.items() if isinstance(value, Mapping) else value
    if not _is_list_like(pairs):
        raise RequestError(
            f"SamplingParams.logit_bias must map token ids to numbers, got {_describe(value)}"
        )
    biases: dict[int, float] = {}
    for pair in pairs:
        if not (isinstance(pair, tuple) and len(pair) == 2):
            raise RequestError(
                f"SamplingParams.logit_bias must map token ids to numbers, got {_describe(value)}"
            )
        token, bias = pair
        if not is_int(token) or token < 0:
            raise RequestError(
                f"SamplingParams.logit_bias keys must be non-negative token ids, got {token!r}"
            )
        if isinstance(bias, bool) or not isinstance(bias, Real) or not math.isfinite(bias):
            raise RequestError(
                f"SamplingParams.logit_bias[{token}] must be a finite number, got {_describe(bias)}"
            )
        biases[int(token)] = float(bias)
    return tuple(sorted(biases.items()))


def _bad_words(value: Any) -> tuple[str, ...]:
    if value is None:  # as vLLM takes it: none
        return ()
    if not _is_list_like(value):
        raise RequestError(
            f"SamplingParams.bad_words must be a list of strings, got {_describe(value)}"
        )
    words = tuple(value)
    bad = [w for w in words if not isinstance(w, str) or not w.strip()]
    if bad:
        # A blank word has no tokens to ban.
        raise RequestError(
            f"SamplingParams.bad_words must hold non-blank strings, got {bad[:5]!r}"
        )
    return words


def _one_of(*choices: str):
    def check(_instance: object, attribute: attrs.Attribute, value: Any) -> None:
        if value not in choices:
            raise RequestError(
                f"SamplingParams.{attribute.name} must be one of {list(choices)}, got "
                f"{_describe(value)}"
            )

    return check


def _between(low: float, high: float, *, low_open: bool = False):
    def check(_instance: object, attribute: attrs.Attribute, value: Any) -> None:
        _finite(_instance, attribute, value)
        if value < low or (low_open and value == low) or value > high:
            bound = (f"> {low:g}" if high == math.inf
                     else f"in {'(' if low_open else '['}{low:g}, {high:g}]")
            raise RequestError(f"SamplingParams.{attribute.name} must be {bound}, got {value}")

    return check


def _stop_strings(value: Any) -> tuple[str, ...]:
    if value is None:  # as vLLM takes it: none
        return ()
    if isinstance(value, str):
        value = (value,)
    if not _is_list_like(value):
        raise RequestError(
            f"SamplingParams.stop must be a string or a list of strings, got {_describe(value)}"
        )
    stops = tuple(value)
    bad = [s for s in stops if not isinstance(s, str) or not s]
    if bad:
        # An empty string would match at once, ending every request before a token.
        raise RequestError(
            f"SamplingParams.stop must hold non-empty strings, got {bad[:5]!r}"
        )
    return stops


@attrs.frozen(kw_only=True)
class SamplingParams:
    """How to pick tokens for one request.

    ``temperature == 0`` is greedy. ``top_k <= 0`` and ``top_p == 1`` disable those
    filters. ``seed`` makes sampling reproducible per request whatever the batch.
    Without one the engine keys the request by its own seed (``EngineConfig.seed``)
    and the request's id: still independent of the batch, and two engines with the
    same seed given the same requests in the same order draw the same tokens.
    ``logprobs=None`` returns none; ``logprobs=N`` returns the sampled token's logprob
    and the N most likely tokens' logprobs at every step. ``n`` samples are drawn for
    the prompt (a GRPO group); :meth:`for_sample` gives each sample's own params.
    ``stop`` (a string or a list of them) ends a request as soon as its output text
    holds one of them (finish reason ``"stop"``): the output text ends before the
    stop string, and no token after the one that completed it is kept. It needs the
    model's tokenizer; a model without one refuses such a request.
    ``prompt_logprobs=N`` also returns each prompt token's logprob given the tokens
    before it, and the N most likely tokens' logprobs there (``RequestOutput.
    prompt_logprobs``, ``None`` for the first token, as vLLM's): computed by the
    prefill itself, so such a request computes its whole prompt (no prefix-cache
    hit: a cached block has no logits to give).

    vLLM's logit adjustments, applied in vLLM's order to the logits a token is
    picked from (greedy rows included, ``min_p`` only where the row draws); the
    logprobs returned are those of the raw logits under the engine's default
    ``logprobs_mode="raw_logprobs"``, of the adjusted ones under the processed modes
    (``layers/logprobs_mode.py``): ``allowed_token_ids`` (every other token is
    masked), ``bad_words`` (a word's last token is masked where the output so far
    ends with the rest of it; each word banned as written and with a leading space,
    tokenized by the engine), ``min_tokens`` (the stop token ids and EOS are masked
    until that many tokens were generated), ``logit_bias`` (``{token_id: bias}``
    added), ``repetition_penalty`` (a token seen in the prompt or the output has a
    positive logit divided by it, a negative one multiplied), ``frequency_penalty``
    (subtracted once per time the token is in the output) and ``presence_penalty``
    (subtracted once if it is), then, after the temperature, ``min_p`` (a token less
    likely than ``min_p`` times the likeliest one is masked). At their neutral values
    they cost nothing. ``penalty_rules="sglang"`` applies SGLang's rules instead: the
    repetition penalty counts the output's tokens alone, the frequency and presence
    penalties are subtracted before it divides or multiplies, and ``logit_bias`` is
    added after all three.
    ``include_stop_str_in_output`` keeps a matched stop string in the output text,
    ``skip_special_tokens`` drops special tokens from it, and
    ``spaces_between_special_tokens`` is taken for vLLM's and SGLang's sake: the
    tokenizers library's decoding has no such switch (as vLLM's fast-tokenizer path).
    ``return_kept_mass`` reports each sampled token's kept mass
    (``RequestOutput.kept_mass``): the probability, at the request's temperature, of
    the tokens ``min_p``, top-k and top-p kept when it was drawn.

    ``return_routed_experts`` returns, for a mixture-of-experts model served with
    ``enable_return_routed_experts``, the experts the router chose for every token
    the model computed: ``RequestOutput.routed_experts``, shaped as SGLang's and
    vLLM's, ``[prompt + output - 1, num_hidden_layers, top_k]`` (the last output token
    is never fed back); the prompt's rows come from the prefix cache where it hit.

    ``structured_outputs`` (:class:`~kvrunner.structured_outputs.StructuredOutputsParams`,
    or a mapping of its fields) holds the output to a JSON schema, any JSON object, a
    regex, one of a list of choices, an EBNF or Lark grammar or a structural tag: every
    step, the tokens the constraint cannot continue with are masked before the token is
    picked, and the request ends (finish reason ``"stop"``) when the constraint is
    complete and its stop token drawn. As in vLLM, the logprobs returned for such a
    request, in every ``logprobs_mode``, are of the masked logits. It needs the
    ``xgrammar`` package (``kvrunner[structured]``) and the model's tokenizer.
    ``reasoning_end_token_id`` lets a reasoning model think first, as vLLM's reasoning
    parser does: the constraint applies only after the output holds that token (Qwen3's
    ``</think>``); the tokens up to and including it are drawn unmasked and are not fed
    to the grammar. ``kvrunner serve`` sets it when its ``--reasoning-parser`` is on and
    the request's thinking is enabled.

    :raises RequestError: naming the field, for a value of the wrong type or range.
    """

    max_tokens: int = attrs.field(default=16, validator=_int_field(minimum=1))
    temperature: float = attrs.field(default=1.0, validator=_finite)
    top_k: int = attrs.field(default=0, validator=_int_field())
    top_p: float = attrs.field(default=1.0, validator=_finite)
    seed: int | None = attrs.field(default=None, validator=_int_field(optional=True))
    ignore_eos: bool = attrs.field(default=False, validator=_bool)
    stop_token_ids: tuple[int, ...] = attrs.field(default=(), converter=_token_ids)
    logprobs: int | None = attrs.field(
        default=None, validator=_int_field(minimum=0, optional=True)
    )
    n: int = attrs.field(default=1, validator=_int_field(minimum=1))
    stop: tuple[str, ...] = attrs.field(default=(), converter=_stop_strings)
    prompt_logprobs: int | None = attrs.field(
        default=None, validator=_int_field(minimum=0, optional=True)
    )
    presence_penalty: float = attrs.field(default=0.0, validator=_between(-2.0, 2.0))
    frequency_penalty: float = attrs.field(default=0.0, validator=_between(-2.0, 2.0))
    repetition_penalty: float = attrs.field(
        default=1.0, validator=_between(0.0, math.inf, low_open=True)
    )
    #: whose rules the penalties and ``logit_bias`` follow: "vllm" or "sglang"
    penalty_rules: str = attrs.field(default="vllm", validator=_one_of("vllm", "sglang"))
    min_p: float = attrs.field(default=0.0, validator=_between(0.0, 1.0))
    min_tokens: int = attrs.field(default=0, validator=_int_field(minimum=0))
    #: ``(token_id, bias)`` pairs, by token id (given as a mapping or pairs)
    logit_bias: tuple[tuple[int, float], ...] = attrs.field(default=(), converter=_logit_bias)
    #: the tokens that may be sampled (sorted, distinct); None allows every one
    allowed_token_ids: tuple[int, ...] | None = attrs.field(
        default=None, converter=_optional_token_ids
    )
    bad_words: tuple[str, ...] = attrs.field(default=(), converter=_bad_words)
    include_stop_str_in_output: bool = attrs.field(default=False, validator=_bool)
    skip_special_tokens: bool = attrs.field(default=True, validator=_bool)
    spaces_between_special_tokens: bool = attrs.field(default=True, validator=_bool)
    #: report each sampled token's kept mass (``RequestOutput.kept_mass``)
    return_kept_mass: bool = attrs.field(default=False, validator=_bool)
    return_routed_experts: bool = attrs.field(default=False, validator=_bool)
    #: the output's constraint (a JSON schema, a regex, choices, a grammar); None: none
    structured_outputs: StructuredOutputsParams | None = attrs.field(
        default=None, converter=StructuredOutputsParams.of
    )
    #: the token that ends the reasoning: ``structured_outputs`` applies after it; None:
    #: from the first output token
    reasoning_end_token_id: int | None = attrs.field(
        default=None, validator=_int_field(minimum=0, optional=True)
    )

    def __attrs_post_init__(self) -> None:
        if self.temperature < 0:
            raise RequestError(
                f"SamplingParams.temperature must be >= 0, got {self.temperature}"
            )
        if not 0.0 < self.top_p <= 1.0:
            raise RequestError(f"SamplingParams.top_p must be in (0, 1], got {self.top_p}")
        if self.min_tokens > self.max_tokens:
            raise RequestError(
                f"SamplingParams.min_tokens={self.min_tokens} must be at most "
                f"max_tokens={self.max_tokens}"
            )
        if self.reasoning_end_token_id is not None and self.structured_outputs is None:
            raise RequestError(
                f"SamplingParams.reasoning_end_token_id={self.reasoning_end_token_id} says "
                f"where structured_outputs starts to apply, but the request has no "
                f"structured_outputs"
            )

    @property
    def adjusts_logits(self) -> bool:
        """Whether any of vLLM's logit adjustments is away from its neutral value (the
        sampler's extra work: see the class docstring)."""
        return bool(
            self.repetition_penalty != 1.0 or self.presence_penalty or self.frequency_penalty
            or self.min_p or self.min_tokens or self.logit_bias
            or self.allowed_token_ids is not None or self.bad_words
        )

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def for_sample(self, k: int) -> SamplingParams:
        """The params of sample ``k`` (``0 <= k < n``) of this request's group: these
        params with ``n=1`` and, when a seed is set, that sample's own seed.

        The seed rule: sample 0 keeps ``seed`` (so ``n=1`` and sample 0 of a group
        draw the same tokens); sample ``k > 0`` gets the 63-bit BLAKE2b digest of
        ``("kvrunner-sample", seed, k)``. The ``n`` samples so differ from each other,
        and a group drawn again with the same seed repeats them exactly, on any
        process or Python version. Without a seed the engine keys each sample by its
        own request id, which already differs per sample.

        :raises RequestError: for a ``k`` that is not an integer in ``[0, n)``.
        """
        if not is_int(k) or not 0 <= k < self.n:
            raise RequestError(
                f"SamplingParams.for_sample: sample index must be an integer in "
                f"[0, {self.n}) (n={self.n}), got {_describe(k)}"
            )
        if self.n == 1:
            return self  # sample 0 of a group of one: these very params
        seed = self.seed
        if seed is not None and k > 0:
            digest = hashlib.blake2b(
                f"kvrunner-sample:{seed}:{int(k)}".encode(), digest_size=8
            ).digest()
            seed = int.from_bytes(digest, "little") >> 1
        return attrs.evolve(self, n=1, seed=seed)
