"""Hypothesis strategies for batch-invariance probes: one request, and a mix to run it in.

A :class:`ProbeCase` is a probe request (its prompt and sampling), the other requests
it shares an engine with (their number, prompt lengths and outputs; some open with
the probe's own prefix), the probe's place among them, and how the mixed engine
runs: its chunked-prefill budget, a pool small enough to preempt or not, the probe's
prefix cached beforehand or not, asynchronous steps and graphs (the CPU's eager
stand-in) on or off, and a sleep/wake cycle first or not.
"""

from __future__ import annotations

import attrs
from hypothesis import strategies as st

from kvrunner.sampling_params import SamplingParams

#: the kit's tiny engine: every mixed engine shares these
MAX_SEQS = 4
BLOCK_SIZE = 4
MAX_MODEL_LEN = 96
#: token ids the probes draw (the tiny models' vocabularies are larger)
VOCAB = 400
#: every engine's pool unless it is the small one: four full-length requests and room
#: for the prefix cache, a fixed count so that no engine depends on the device's free
#: memory (on a GPU other engines of the same process may still hold theirs)
POOL = 128
#: a pool of 22 blocks (88 tokens) cannot hold four long requests: the scheduler
#: preempts one and recomputes it later
SMALL_POOL = 22
#: chunked-prefill budgets (tokens per step) of the mixed engines
BUDGETS = (5, 7, 16, 256)


@attrs.frozen
class Mixed:
    """How the engine the probe shares with others is set up."""

    budget: int
    small_pool: bool
    async_scheduling: bool
    enforce_eager: bool

    def settings(self) -> dict:
        """Engine keyword arguments (beyond the kit's common ones)."""
        return dict(max_num_batched_tokens=self.budget, async_scheduling=self.async_scheduling,
                    enforce_eager=self.enforce_eager,
                    **({"num_blocks": SMALL_POOL} if self.small_pool else {}))


@attrs.frozen
class ProbeCase:
    probe: list[int]
    params: SamplingParams
    #: the other requests: (prompt, sampling)
    others: list[tuple[list[int], SamplingParams]]
    #: the probe's index among the submitted requests (capped by their number)
    position: int
    mixed: Mixed
    #: the probe's prompt is served once on the mixed engine first (a prefix-cache hit)
    warm_prefix: bool
    #: the mixed engine sleeps and wakes before the mix
    sleep_first: bool

    def requests(self) -> tuple[list[list[int]], list[SamplingParams], int]:
        """Prompts and sampling of the mix, in submission order, and the probe's index."""
        at = min(self.position, len(self.others))
        prompts = [p for p, _ in self.others]
        params = [sp for _, sp in self.others]
        return ([*prompts[:at], self.probe, *prompts[at:]],
                [*params[:at], self.params, *params[at:]], at)


_tokens = st.integers(1, VOCAB - 1)
_probe_params = st.builds(
    SamplingParams, max_tokens=st.integers(1, 8), temperature=st.sampled_from([0.0, 0.9]),
    seed=st.integers(0, 99), logprobs=st.sampled_from([0, 2]),
    prompt_logprobs=st.sampled_from([None, 0]), ignore_eos=st.just(True),
)  # fmt: skip
_other_params = st.builds(
    SamplingParams, max_tokens=st.integers(1, 32), temperature=st.sampled_from([0.0, 1.0]),
    ignore_eos=st.booleans(),
)  # fmt: skip


@st.composite
def _other(draw: st.DrawFn, probe: list[int]) -> tuple[list[int], SamplingParams]:
    """Another request; about one in three opens with a prefix of the probe's prompt."""
    tail = draw(st.lists(_tokens, min_size=1, max_size=24))
    shared = draw(st.integers(0, len(probe))) if draw(st.integers(0, 2)) == 0 else 0
    return [*probe[:shared], *tail], draw(_other_params)


@st.composite
def probe_cases(draw: st.DrawFn, *, max_others: int = 5) -> ProbeCase:
    """A probe and a mix of up to ``max_others`` other requests (none: alone again,
    on a differently set-up engine)."""
    probe = draw(st.lists(_tokens, min_size=2, max_size=20))
    return ProbeCase(
        probe=probe,
        params=draw(_probe_params),
        others=draw(st.lists(_other(probe), min_size=0, max_size=max_others)),
        position=draw(st.integers(0, max_others)),
        mixed=draw(st.builds(Mixed, budget=st.sampled_from(BUDGETS), small_pool=st.booleans(),
                             async_scheduling=st.booleans(), enforce_eager=st.booleans())),
        warm_prefix=draw(st.booleans()),
        sleep_first=draw(st.booleans()),
    )
