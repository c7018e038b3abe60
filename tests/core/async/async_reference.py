"""What an AsyncLLM request must produce: the synchronous engine, stepped by hand, one
request at a time, switching weights at the output positions the request's
``weight_versions`` spans name (a request parked across a weight update keeps the KV
its earlier tokens were computed with, and so does this reference).

Synchronous steps, so that after each ``step()`` the request's tokens are exactly
those applied; no preemption happens in these small runs, which is what lets a
parked request's KV carry over unchanged.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import pytest
import torch

from kvrunner import LLM, SamplingParams
from kvrunner.models.loader import iter_safetensors
from kvrunner.outputs import RequestOutput

#: 4 seats and a pool of 24 blocks of 4 tokens: every mix of up to 4 running requests
#: of at most 8 + 10 tokens fits, so nothing is preempted
SETTINGS = dict(
    max_num_seqs=4, max_num_batched_tokens=32, max_model_len=64, block_size=4,
    num_blocks=24, capture_sizes=(1, 2, 4),
)


def weights_of(path: str) -> dict[str, torch.Tensor]:
    return dict(iter_safetensors(Path(path), torch.float32))


class Reference:
    """Outputs of the synchronous ``LLM`` for given weight switches, memoised.

    :param paths: the checkpoints; weight set ``j`` is ``paths[j]``'s tensors.
    """

    def __init__(self, paths: Sequence[str]) -> None:
        self.llm = LLM(paths[0], async_scheduling=False, **SETTINGS)
        self.weights = [weights_of(p) for p in paths]
        self.current = 0
        self._memo: dict[tuple, RequestOutput] = {}

    def output(
        self, prompt: Sequence[int], params: SamplingParams,
        switches: Sequence[tuple[int, int]] = ((0, 0),),
    ) -> RequestOutput:
        """The request's output made with weight set ``j`` from output index ``i`` on,
        for each ``(j, i)`` of ``switches`` (the first at index 0)."""
        key = (tuple(prompt), params, tuple(switches))
        if key not in self._memo:
            self._memo[key] = self._run(list(prompt), params, list(switches))
        return self._memo[key]

    def _run(self, prompt: list[int], params: SamplingParams,
             switches: list[tuple[int, int]]) -> RequestOutput:  # fmt: skip
        engine = self.llm.engine
        assert switches[0][1] == 0
        self._use(switches.pop(0)[0])
        self.llm.reset_prefix_cache()  # no KV of an earlier reference run is reused
        seq = engine.make_request(prompt, params, 0)
        engine.add_request(seq)
        while engine.has_unfinished():
            if switches and seq.num_output_tokens == switches[0][1]:
                engine.park()
                self._use(switches.pop(0)[0])
                engine.unpark()
            engine.step()
        assert not switches, f"the request ended before the switch at {switches}"
        return self.llm._output(prompt, seq)

    def _use(self, j: int) -> None:
        if j != self.current:
            self.llm.update_weights(self.weights[j])
            self.current = j

    def shutdown(self) -> None:
        self.llm.shutdown()


def assert_matches(got: RequestOutput, want: RequestOutput, *, prefix: bool = False) -> None:
    """``got`` is ``want`` (or, with ``prefix``, its first tokens: an aborted request);
    logprobs to the CPU's rounding across batch compositions."""
    n = len(got.token_ids)
    if prefix:
        assert got.token_ids == want.token_ids[:n]
    else:
        assert (got.token_ids, got.finish_reason) == (want.token_ids, want.finish_reason)
    if want.logprobs is not None:
        assert got.logprobs == pytest.approx(want.logprobs[:n], abs=1e-5)
