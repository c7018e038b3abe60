"""One request as the engine tracks it: its tokens, its place in the cache, its fate.

A :class:`Sequence` is plain mutable bookkeeping. The scheduler moves it between
states, the block manager fills in ``block_table`` / ``state_slot`` /
``num_computed_tokens``; nothing here touches tensors.
"""

from __future__ import annotations

import enum
from typing import TYPE_CHECKING, Any, Literal

import attrs
import numpy as np

from kvrunner.sampling_params import SamplingParams

if TYPE_CHECKING:
    from kvrunner.engine.stop_strings import StopStringWatch

#: Why a sequence stopped: ``stop`` (EOS or a stop token), ``length`` (``max_tokens``
#: or ``max_model_len``), ``abort`` (the caller withdrew it), ``error`` (its logits
#: row was non-finite: ``Sequence.error`` says which step and why).
FinishReason = Literal["stop", "length", "abort", "error"]


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@attrs.define(eq=False, on_setattr=attrs.setters.NO_OP)
class Sequence:
    """A request's tokens (prompt then generated) and where its KV lives.

    Invariant while RUNNING: ``num_computed_tokens <= len(token_ids)`` and the block
    table holds at least ``ceil(num_computed_tokens / block_size)`` blocks. A token
    just sampled is in ``token_ids`` but not yet computed: it is fed to the model in
    the next step, so a decoding sequence has ``num_computed_tokens ==
    len(token_ids) - 1``.

    ``eq=False`` keeps identity semantics (and hashability): two requests with the
    same prompt are still two requests. Assignments are plain slot writes
    (``on_setattr=NO_OP``): the scheduler updates every running sequence on every
    step, and attrs' per-assignment hook cost more than the assignment.
    """

    seq_id: int
    prompt_token_ids: tuple[int, ...] = attrs.field(converter=tuple)
    sampling_params: SamplingParams = attrs.field(factory=SamplingParams)
    #: prompt followed by every generated token (generated tokens survive preemption)
    token_ids: list[int] = attrs.field(init=False)
    #: leading tokens of ``token_ids`` whose KV is in the cache
    num_computed_tokens: int = attrs.field(default=0, init=False)
    #: physical KV block ids, in logical order
    block_table: list[int] = attrs.field(factory=list, init=False)
    #: prefix-cache hashes of the leading full blocks of ``token_ids``; they depend on
    #: the tokens and ``hash_salt`` only, so they are reused across a preemption
    #: unless the salt changed (the block manager rekeys a sequence at admission)
    block_hashes: list[int] = attrs.field(factory=list, init=False)
    #: the caller's prefix-cache namespace (vLLM's ``cache_salt``, SGLang's
    #: ``extra_key``): only requests with the same one share cached blocks
    cache_salt: str | None = attrs.field(default=None, kw_only=True)
    #: the salt ``block_hashes`` were computed with (``engine/cache_salt.py``: the
    #: ``cache_salt`` and the weight version at its last admission)
    hash_salt: bytes | None = attrs.field(default=None, init=False)
    #: the block manager's salt epoch ``hash_salt`` was found in (-1: never keyed)
    salt_epoch: int = attrs.field(default=-1, init=False)
    #: prompt tokens its first admission took from the prefix cache (-1 before it)
    num_cached_tokens: int = attrs.field(default=-1, init=False)
    #: recurrent-state slot while running, ``-1`` when the sequence holds none
    state_slot: int = attrs.field(default=-1, init=False)
    #: the block manager's row holding ``block_table`` again (``-1`` while none)
    table_row: int = attrs.field(default=-1, init=False)
    status: SequenceStatus = attrs.field(default=SequenceStatus.WAITING, init=False)
    finish_reason: FinishReason | None = attrs.field(default=None, init=False)
    #: why it ended with ``"error"``: the engine step (counted since start), the output
    #: position and the cause (``"step 12 (output token 3): logits hold NaN"``), else None
    error: str | None = attrs.field(default=None, init=False)
    #: the sampled token's logprob at each output position (``None`` if not asked)
    logprobs: list[float | None] = attrs.field(factory=list, init=False)
    #: the top-N logprobs at each output position (``None`` if not asked)
    top_logprobs: list[dict[int, float] | None] = attrs.field(factory=list, init=False)
    #: the kept mass of each output token (``SamplingParams.return_kept_mass``; empty
    #: if not asked)
    kept_mass: list[float] = attrs.field(factory=list, init=False)
    #: each prompt token's logprob given the tokens before it, from the second prompt
    #: token on, as its prefill chunks are applied (``SamplingParams.prompt_logprobs``)
    prompt_logprobs: list[float] = attrs.field(factory=list, init=False)
    #: the top-N logprobs at each of those positions (``None`` where N is 0)
    prompt_top_logprobs: list[dict[int, float] | None] = attrs.field(factory=list, init=False)
    #: each of those prompt tokens' rank among its position's logprobs (1: the likeliest)
    prompt_ranks: list[int] = attrs.field(factory=list, init=False)
    #: the routed experts of its positions from 0 on, as the steps returned them: one
    #: ``[tokens, model layers, top_k]`` int32 array each
    #: (``SamplingParams.return_routed_experts``)
    routes: list[np.ndarray] = attrs.field(factory=list, init=False)
    #: the positions :attr:`routes` holds
    num_routes: int = attrs.field(default=0, init=False)
    #: admission order stamp given by the scheduler on ``add`` (-1 before that)
    arrival: int = attrs.field(default=-1, init=False)
    #: ``len(prompt_token_ids)``, kept: the scheduler reads it for every row of every step
    num_prompt_tokens: int = attrs.field(init=False)
    # The finish conditions, folded into one set and one count so that a step checks
    # each sequence with one lookup and one compare. The scheduler's ``add`` folds in
    # its own limits (EOS ids, ``max_model_len``); see ``set_limits``.
    #: token ids that end it ("stop")
    stop_on: frozenset[int] = attrs.field(init=False)
    #: the length (prompt and output) at which it ends ("length")
    length_limit: int = attrs.field(init=False)
    #: which of its request's ``n`` samples this is
    sample_index: int = attrs.field(default=0, kw_only=True)
    #: the sample of its group whose prefill this one waits for, so that its prompt's
    #: KV comes from the prefix cache rather than being computed once per sample
    #: (None: it waits for nobody; see :meth:`waits_for_prefix`)
    prefix_leader: Sequence | None = attrs.field(default=None, kw_only=True)
    #: decodes its output and finds its stop strings (None: it has none)
    stop_watch: StopStringWatch | None = attrs.field(default=None, kw_only=True)
    #: the stop string that ended it, if one did
    stop_string: str | None = attrs.field(default=None, init=False)
    #: its ``SamplingParams.bad_words`` as token ids (``logit_rules.bad_word_token_ids``)
    bad_word_ids: tuple[tuple[int, ...], ...] = attrs.field(default=(), kw_only=True)
    #: its ``SamplingParams.structured_outputs`` compiled for the model's vocabulary (an
    #: ``xgrammar.CompiledGrammar``, ``engine/grammar_compiler.py``), set when the
    #: compile is done; None: unconstrained, or not compiled yet
    grammar: Any = attrs.field(default=None, kw_only=True, repr=False)
    #: how errors found after it was queued name it (``"request 3"``, ``"request 'a'"``;
    #: ``LLMEngine.make_request``); None: by its id
    name: str | None = attrs.field(default=None, kw_only=True, repr=False)

    def __attrs_post_init__(self) -> None:
        self.token_ids = list(self.prompt_token_ids)
        self.num_prompt_tokens = len(self.prompt_token_ids)
        self.set_limits(eos_token_ids=frozenset(), max_model_len=None)

    def set_limits(self, *, eos_token_ids: frozenset[int], max_model_len: int | None) -> None:
        """Fold the model's EOS ids (unless ``ignore_eos``) and ``max_model_len`` into
        ``stop_on`` / ``length_limit``, next to the request's own stop ids and
        ``max_tokens``."""
        params = self.sampling_params
        stops = frozenset(params.stop_token_ids)
        self.stop_on = stops if params.ignore_eos else stops | eos_token_ids
        limit = self.num_prompt_tokens + params.max_tokens
        self.length_limit = limit if max_model_len is None else min(limit, max_model_len)

    def waits_for_prefix(self) -> bool:
        """Whether admitting it now would compute its prompt again: its leader is
        neither finished nor done computing the prompt (its full blocks are published
        to the prefix cache when that step is applied)."""
        leader = self.prefix_leader
        return (
            leader is not None
            and leader.status is not SequenceStatus.FINISHED
            and leader.num_computed_tokens < leader.num_prompt_tokens
        )

    @property
    def stop_reason(self) -> int | str | None:
        """What ended it with ``"stop"``: the stop string, or the last token when it is
        one of ``stop_token_ids``; None otherwise (for an EOS token that is not one, as
        vLLM reports it)."""
        if self.finish_reason != "stop":
            return None
        if self.stop_string is not None:
            return self.stop_string
        last = self.token_ids[-1] if self.num_output_tokens else None
        return last if last in self.sampling_params.stop_token_ids else None

    def routed_experts(self) -> np.ndarray | None:
        """Every position's routes but the last token's (never fed back):
        ``[prompt + output - 1, model layers, top_k]`` int32, as far as the applied
        steps reach; None before any step returned one."""
        if not self.routes:
            return None
        if len(self.routes) > 1:  # joined once: the next call reads one array
            self.routes[:] = [np.concatenate(self.routes)]
        return self.routes[0][: len(self.token_ids) - 1]

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - len(self.prompt_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[len(self.prompt_token_ids) :]

    @property
    def num_uncomputed_tokens(self) -> int:
        """Tokens still to feed before the next token can be sampled."""
        return len(self.token_ids) - self.num_computed_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def __repr__(self) -> str:
        return (
            f"Sequence(id={self.seq_id}, {self.status.value}, tokens={self.num_tokens} "
            f"(prompt {self.num_prompt_tokens}), computed={self.num_computed_tokens}, "
            f"blocks={self.block_table}, slot={self.state_slot})"
        )
