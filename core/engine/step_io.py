"""The engine -> runner boundary: what one step asks the runner to compute.

Plain, picklable data (no tensors), so the same object crosses to worker processes.
Crossing is a per-step cost on the decode path, so both directions are columns
(one list per field; the block tables and the sampling settings numpy arrays), never
one object per sequence: a :class:`StepInput` is columns, and the runner answers with
the sampled tokens as columns (:data:`PackedSampled`), which the engine reads as they
are (:class:`SampledTokens`). At batch 256 that is about 5x less pickling work than
one object per sequence.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from collections.abc import Sequence as Seq

import attrs
import numpy as np

from kvrunner.engine.logit_rules import LogitRules, logit_rules
from kvrunner.engine.token_masks import TokenMasks
from kvrunner.sampling_params import SamplingParams, int64_seed

#: A token id in ``StepInput.token_ids`` that the host does not know yet: the token
#: this sequence sampled in the step just before, which is still on the device (async
#: scheduling). It is only ever the last token of a chunk, and the runner replaces it
#: with the device's token before the forward runs.
PLACEHOLDER_TOKEN = -1
#: the chunk of a decoding sequence whose newest token is still on the device (one
#: shared tuple: building one per sequence per step costs the host time it saves)
PLACEHOLDER_CHUNK = (PLACEHOLDER_TOKEN,)

#: Token ids the runner answers in place of a row's sample when the row's logits
#: are non-finite, by cause (the row's maximum tells them apart: NaN propagates
#: through the max, +inf is the max, and a row whose every logit is -inf has nothing
#: to sample). A -inf logit among finite ones is a mask and counts as finite. The
#: engine ends such a request with finish reason "error" and never records the token.
NONFINITE_CAUSES: dict[int, str] = {
    -2: "logits hold NaN",
    -3: "logits hold +inf",
    -4: "every logit is -inf",
}


class BlockTables(Seq[tuple[int, ...]]):
    """Every sequence's block table in one step, as one zero-padded int32 array.

    Row ``i`` holds sequence ``i``'s blocks in its first ``lens[i]`` entries and 0
    after them (block 0 exists in any pool, so a padded entry never reads out of
    range); the width is the longest table, at least 1. The engine gathers it from
    its persistent per-request rows in one numpy pass and the runner uses the array
    as it is: building and flattening a tuple per sequence cost about 1 µs each per
    step. Reads as a sequence of tuples, as the tables were before.
    """

    __slots__ = ("array", "lens")

    def __init__(self, array: np.ndarray, lens: np.ndarray) -> None:
        n = len(lens)
        width = max(int(lens.max(initial=0)), 1)
        if array.dtype != np.int32 or array.shape != (n, width):
            raise ValueError(
                f"block tables of {n} sequences, longest {width}, need an int32 array of "
                f"shape ({n}, {width}), got {array.dtype} {array.shape}"
            )
        self.array = array
        #: [num_seqs] int64: blocks in each table
        self.lens = lens.astype(np.int64, copy=False)

    @classmethod
    def from_rows(cls, rows: Iterable[Seq[int]]) -> BlockTables:
        """The tables given one sequence of block ids each."""
        rows = [tuple(r) for r in rows]
        lens = np.fromiter(map(len, rows), np.int64, len(rows))
        array = np.zeros((len(rows), max(int(lens.max(initial=0)), 1)), np.int32)
        for i, row in enumerate(rows):
            array[i, : len(row)] = row
        return cls(array, lens)

    def __len__(self) -> int:
        return len(self.lens)

    def __getitem__(self, index):  # type: ignore[override]  # int or slice, as a list
        if isinstance(index, slice):
            return list(self)[index]
        return tuple(self.array[index, : self.lens[index]].tolist())

    def __iter__(self) -> Iterator[tuple[int, ...]]:
        for row, n in zip(self.array.tolist(), self.lens.tolist(), strict=True):
            yield tuple(row[:n])

    def __eq__(self, other: object) -> bool:
        if isinstance(other, BlockTables):
            return np.array_equal(self.lens, other.lens) and np.array_equal(
                self.array, other.array
            )
        if isinstance(other, Seq) and not isinstance(other, str | bytes):
            return list(self) == [tuple(t) for t in other]
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]  # arrays, like a list

    def __repr__(self) -> str:
        return f"BlockTables({list(self)!r})"

    def __reduce__(self) -> tuple:
        # Two arrays: one buffer each on the wire, whatever the batch.
        return (BlockTables, (self.array, self.lens))


def as_block_tables(tables: BlockTables | Iterable[Seq[int]]) -> BlockTables:
    """``tables`` as :class:`BlockTables` (tests and tools build lists of tuples)."""
    return tables if isinstance(tables, BlockTables) else BlockTables.from_rows(tables)


#: the largest value an int64 column holds: a larger top-k or logprobs count means
#: the same as this one (more than any vocabulary)
_INT64_MAX = 2**63 - 1

#: the :class:`SamplingColumns`' columns, in their order, and each one's dtype
SAMPLING_DTYPES: dict[str, type] = {
    "temperature": np.float64,
    "top_k": np.int64,
    "top_p": np.float64,
    "seed": np.int64,
    "has_seed": np.bool_,
    "logprobs": np.int64,
    "prompt_logprobs": np.int64,
    "kept_mass": np.bool_,
}

#: a row of the :class:`SamplingColumns`: one value per column, in their order
SamplingRow = tuple[float, int, float, int, bool, int, int, bool]


def sampling_row(params: SamplingParams) -> SamplingRow:
    """``params`` as one row of the :class:`SamplingColumns` (see there what each holds)."""
    top_k, seed = int(params.top_k), params.seed
    logprobs, prompt_logprobs = params.logprobs, params.prompt_logprobs
    return (
        float(params.temperature),
        top_k if 0 < top_k <= _INT64_MAX else 0,
        float(params.top_p),
        0 if seed is None else int64_seed(int(seed)),
        seed is not None,
        -1 if logprobs is None else min(int(logprobs), _INT64_MAX),
        -1 if prompt_logprobs is None else min(int(prompt_logprobs), _INT64_MAX),
        bool(params.return_kept_mass),
    )


@attrs.frozen(eq=False)
class SamplingColumns:
    """Every row's sampling settings as numpy columns, row ``i`` of each sequence ``i``'s.

    The engine keeps them in the running batch from a request's admission
    (``running_batch.py``) and gathers a step's rows from there; the sampler and the
    decode graphs read them as they are, and their device uploads come straight from
    the arrays. They pickle as eight arrays, whatever the batch. Each column holds a
    :class:`~kvrunner.sampling_params.SamplingParams` field in a form an array can
    hold (:func:`sampling_row`).

    ``rules``: each row's :class:`~kvrunner.engine.logit_rules.LogitRules` (None for a
    row without), or None when no row has any: the common case costs nothing.
    ``masks``: the tokens each row under a structured-output constraint may sample this
    step (:class:`~kvrunner.engine.token_masks.TokenMasks`), or None when no row has one.
    """

    #: [N] float64: 0 is greedy
    temperature: np.ndarray
    #: [N] int64: keep the ``top_k`` most likely tokens; 0 where it keeps every one
    #: (``top_k <= 0``)
    top_k: np.ndarray
    #: [N] float64: keep the smallest most-likely set of at least this probability;
    #: 1 keeps every token
    top_p: np.ndarray
    #: [N] int64: the draw key of the row's own seed (``int64_seed``: the seed itself
    #: where it fits an int64), 0 where it has none
    seed: np.ndarray
    #: [N] bool: the row has a seed of its own
    has_seed: np.ndarray
    #: [N] int64: top logprobs reported per output token (0: the sampled token's logprob
    #: alone); -1 where the row asks for no logprobs
    logprobs: np.ndarray
    #: [N] int64: top logprobs reported per prompt token; -1 where it scores no prompt
    prompt_logprobs: np.ndarray
    #: [N] bool: the row reports each sampled token's kept mass
    #: (``SamplingParams.return_kept_mass``)
    kept_mass: np.ndarray
    #: per row its logit rules or None; None when no row has any
    rules: tuple[LogitRules | None, ...] | None = None
    #: the constrained rows' token masks; None when no row is constrained
    masks: TokenMasks | None = None

    def __attrs_post_init__(self) -> None:
        n = len(self.temperature)
        if self.rules is not None and len(self.rules) != n:
            raise ValueError(f"sampling columns of {n} rows with {len(self.rules)} rules")
        if self.masks is not None and len(self.masks.rows) and int(self.masks.rows[-1]) >= n:
            raise ValueError(f"sampling columns of {n} rows with a mask for row "
                             f"{int(self.masks.rows[-1])}")
        if any(len(column) != n for column in self.arrays()):
            raise ValueError(
                "sampling columns differ in length: "
                + ", ".join(f"{len(c)} {name}" for name, c in zip(SAMPLING_DTYPES,
                                                                  self.arrays(), strict=True))
            )

    @classmethod
    def of(cls, params: Iterable[SamplingParams]) -> SamplingColumns:
        """The columns of one ``SamplingParams`` per row (tests and tools list them)."""
        params = list(params)
        rows = [sampling_row(p) for p in params]
        values = list(zip(*rows, strict=True)) if rows else [()] * len(SAMPLING_DTYPES)
        rules = tuple(
            logit_rules(p, stop_on=frozenset(p.stop_token_ids), bad_words=(), history_row=-1)
            if p.adjusts_logits else None for p in params
        )  # fmt: skip
        return cls(*(np.array(v, dtype) for v, dtype in zip(values, SAMPLING_DTYPES.values(),
                                                             strict=True)),
                   rules=rules if any(r is not None for r in rules) else None)  # fmt: skip

    def arrays(self) -> tuple[np.ndarray, ...]:
        """The columns, in their order (:data:`SAMPLING_DTYPES`)."""
        return (self.temperature, self.top_k, self.top_p, self.seed, self.has_seed,
                self.logprobs, self.prompt_logprobs, self.kept_mass)  # fmt: skip

    def take(self, rows: np.ndarray | Seq[int]) -> SamplingColumns:
        """The columns of ``rows`` (indices), in that order: new arrays."""
        index = np.asarray(rows, np.intp)
        rules = None
        if self.rules is not None:
            rules = tuple(self.rules[i] for i in index.tolist())
            rules = rules if any(r is not None for r in rules) else None
        masks = None if self.masks is None else self.masks.take(index)
        return SamplingColumns(*(column[index] for column in self.arrays()), rules=rules,
                               masks=masks)

    @property
    def adjusted(self) -> bool:
        """Whether some row's logits change before its pick (logit rules or a token
        mask): such a step is sampled eagerly, never drawn in a decode graph."""
        return self.rules is not None or self.masks is not None

    @property
    def drawing(self) -> np.ndarray:
        """[N] bool: the rows that draw (not greedy: a temperature above 0)."""
        return self.temperature != 0.0

    def __len__(self) -> int:
        return len(self.temperature)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, SamplingColumns):
            return NotImplemented
        return self.rules == other.rules and self.masks == other.masks and all(
            np.array_equal(a, b) for a, b in zip(self.arrays(), other.arrays(), strict=True))

    __hash__ = None  # type: ignore[assignment]  # arrays, like a list

    def __repr__(self) -> str:
        fields = ", ".join(f"{name}={column.tolist()!r}"
                           for name, column in zip(SAMPLING_DTYPES, self.arrays(), strict=True))
        rules = "" if self.rules is None else f", rules={self.rules!r}"
        masks = "" if self.masks is None else f", masks={self.masks!r}"
        return f"SamplingColumns({fields}{rules}{masks})"

    def __reduce__(self) -> tuple:
        # Eight arrays: one buffer each on the wire, whatever the batch (and the rules
        # of a batch that has any).
        return (SamplingColumns, (*self.arrays(), self.rules, self.masks))


def as_sampling_columns(
    sampling: SamplingColumns | Iterable[SamplingParams],
) -> SamplingColumns:
    """``sampling`` as :class:`SamplingColumns` (tests and tools list ``SamplingParams``)."""
    return sampling if isinstance(sampling, SamplingColumns) else SamplingColumns.of(sampling)


@attrs.frozen(eq=True, hash=False)
class StepInput:
    """One step as columns: one list or array per field, row ``i`` of each sequence ``i``'s.

    Sequence ``i`` feeds ``token_ids[i]`` at positions ``start_pos[i]`` onwards (its
    last token may be :data:`PLACEHOLDER_TOKEN`: the previous step's sample). The
    scheduler builds it this way and the runner reads it this way, so no object per
    sequence is ever built. It pickles as its lists, the block tables' two arrays and
    the sampling columns' eight.
    """

    seq_id: list[int]
    token_ids: list[tuple[int, ...]]
    start_pos: list[int]
    #: every sequence's block table (a list of tuples is converted)
    block_table: BlockTables = attrs.field(converter=as_block_tables)
    state_slot: list[int]
    #: a token is sampled after this share (its prompt is complete)
    sample: list[bool]
    #: every row's sampling settings (a list of ``SamplingParams`` is converted)
    sampling: SamplingColumns = attrs.field(converter=as_sampling_columns)
    #: tokens generated so far; keys the per-request seed
    num_output_tokens: list[int]
    #: for each row, the prompt tokens its chunk's positions predict (the token after
    #: each position, while that is a prompt token): scored for
    #: ``SamplingParams.prompt_logprobs``; ``()`` for a row that scores none, and None
    #: for a step where no row does (every step but a scoring request's prefill)
    prompt_targets: list[tuple[int, ...]] | None = None
    #: for each row, the first position whose routed experts it returns (they run to
    #: the chunk's end: the positions before it come from earlier steps, or from the
    #: prefix cache) or -1 for a row that returns none; None for a step where no row
    #: does (``SamplingParams.return_routed_experts``)
    route_from: list[int] | None = None
    #: the token histories to (re)start before this step samples, by history row
    #: (``LogitRules.history_row``): the request's prompt length, how many latest
    #: output tokens its bad words compare, and every token it has (prompt, then
    #: output); None when no row starts one
    history_init: dict[int, tuple[int, int, tuple[int, ...]]] | None = None

    @property
    def num_seqs(self) -> int:
        return len(self.seq_id)

    @property
    def num_tokens(self) -> int:
        return sum(map(len, self.token_ids))

    @property
    def is_decode(self) -> bool:
        # C-level passes (no generator): the runner asks this on every step.
        return set(map(len, self.token_ids)) <= {1} and min(self.start_pos, default=1) > 0

    def __reduce__(self) -> tuple:
        # The lists themselves: ints pickle in C; attrs' per-object state would not.
        return (StepInput, attrs.astuple(self, recurse=False))


@attrs.frozen(kw_only=True)
class SampledToken:
    seq_id: int
    token_id: int
    logprob: float | None = None
    top_logprobs: dict[int, float] | None = None


#: one chunk's prompt scores: the prompt index of its first scored token, each scored
#: token's logprob, and the top-N logprobs at each (None where N is 0)
PromptScores = tuple[int, list[float], list[dict[int, float] | None], list[int]]

#: one row's routed experts: the position of its first routed token and the expert ids
#: ``[tokens, sparse layers, top_k]`` int32 of that token and the ones after it
StepRoutes = tuple[int, np.ndarray]

#: a step's sampled tokens as columns: seq ids, token ids, logprobs, top logprobs, the
#: prompt scores of the rows that asked for them, by seq id (None: no row asked), each
#: row's kept mass (None for a row that did not ask; the column None when no row did),
#: and the routed experts of the rows that asked for them, by seq id (None: no row asked)
PackedSampled = tuple[list[int], list[int], list[float | None], list[dict[int, float] | None],
                      dict[int, PromptScores] | None, list[float | None] | None,
                      dict[int, StepRoutes] | None]


def no_samples(prompt_scores: dict[int, PromptScores] | None = None,
               routes: dict[int, StepRoutes] | None = None) -> PackedSampled:
    """The columns of a step that sampled nothing (but may have scored prompts or
    recorded routes)."""
    return ([], [], [], [], prompt_scores, None, routes)


class SampledTokens(Seq[SampledToken]):
    """A step's sampled tokens, kept as the runner's columns.

    ``Scheduler.update`` reads the columns themselves; a :class:`SampledToken` is made
    only when someone indexes or iterates (tests, callers of ``execute``). Building
    one attrs object per sequence per step cost about 1 µs each at batch 1024.
    """

    __slots__ = ("seq_ids", "token_ids", "logprobs", "top_logprobs", "prompt_scores",
                 "kept_mass", "routes")  # fmt: skip

    def __init__(
        self,
        seq_ids: list[int],
        token_ids: list[int],
        logprobs: list[float | None],
        top_logprobs: list[dict[int, float] | None],
        prompt_scores: dict[int, PromptScores] | None = None,
        kept_mass: list[float | None] | None = None,
        routes: dict[int, StepRoutes] | None = None,
    ) -> None:
        if not len(seq_ids) == len(token_ids) == len(logprobs) == len(top_logprobs) or (
            kept_mass is not None and len(kept_mass) != len(seq_ids)
        ):
            raise ValueError(
                f"sampled columns differ in length: {len(seq_ids)} seq ids, "
                f"{len(token_ids)} tokens, {len(logprobs)} logprobs, "
                f"{len(top_logprobs)} top logprobs"
                + ("" if kept_mass is None else f", {len(kept_mass)} kept masses")
            )
        self.seq_ids = seq_ids
        self.token_ids = token_ids
        self.logprobs = logprobs
        self.top_logprobs = top_logprobs
        #: the step's prompt scores by seq id (``SamplingParams.prompt_logprobs``)
        self.prompt_scores = prompt_scores
        #: each row's kept mass (``SamplingParams.return_kept_mass``; None for a row
        #: that did not ask), or None when no row asked
        self.kept_mass = kept_mass
        #: the step's routed experts by seq id (``SamplingParams.return_routed_experts``)
        self.routes = routes

    @classmethod
    def of(cls, tokens: Iterable[SampledToken]) -> SampledTokens:
        """The columns of ``tokens`` (itself if it already is columns)."""
        if isinstance(tokens, SampledTokens):
            return tokens
        tokens = list(tokens)
        return cls([t.seq_id for t in tokens], [t.token_id for t in tokens],
                   [t.logprob for t in tokens], [t.top_logprobs for t in tokens])

    def __len__(self) -> int:
        return len(self.seq_ids)

    def __getitem__(self, index):  # type: ignore[override]  # int or slice, as a list
        if isinstance(index, slice):
            return list(self)[index]
        return SampledToken(seq_id=self.seq_ids[index], token_id=self.token_ids[index],
                            logprob=self.logprobs[index], top_logprobs=self.top_logprobs[index])

    def __iter__(self) -> Iterator[SampledToken]:
        for seq_id, token_id, logprob, top in zip(
            self.seq_ids, self.token_ids, self.logprobs, self.top_logprobs, strict=True
        ):
            yield SampledToken(seq_id=seq_id, token_id=token_id, logprob=logprob,
                               top_logprobs=top)

    def __eq__(self, other: object) -> bool:
        # Equal to any sequence of the same tokens, a list of SampledToken included.
        if isinstance(other, SampledTokens):
            return (self.seq_ids, self.token_ids, self.logprobs, self.top_logprobs) == (
                other.seq_ids, other.token_ids, other.logprobs, other.top_logprobs)
        if isinstance(other, Seq) and not isinstance(other, str | bytes):
            return list(self) == list(other)
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]  # mutable columns, like a list

    def __repr__(self) -> str:
        return f"SampledTokens({list(self)!r})"

    def __reduce__(self) -> tuple:
        return (SampledTokens, (self.seq_ids, self.token_ids, self.logprobs, self.top_logprobs,
                                self.prompt_scores, self.kept_mass, self.routes))


def unpack_sampled(packed: PackedSampled) -> SampledTokens:
    """The columns the runner answers with, as the engine reads them (no object per
    row: see :class:`SampledTokens`)."""
    return SampledTokens(*packed)
