"""The tokens each penalised request has seen, kept on the device between steps.

A request whose logit rules read its tokens (a repetition, presence or frequency
penalty, or a bad word of several tokens) holds one history row, handed out by the
engine's running batch (``LogitRules.history_row``). The row holds:

* ``prompt``: which tokens its prompt holds (the repetition penalty counts them);
* ``counts``: how many times each token is in its output (frequency and presence);
* ``recent``: its latest output tokens, newest last (-1 before the first), as many
  as its longest bad word compares.

A step that admits the request restarts its row from the tokens the host knows
(``StepInput.history_init``: the prompt and, after a preemption, the output so far);
every sampled token is then added on the device, right after it is drawn, so the
next step (launched before the host has read this one's tokens) sees it. No host
read, no per-row host work in a steady step. The rows grow, by doubling, as the
engine hands out more of them; ``counts`` is int32 ``[rows, vocab]`` and ``prompt``
bool ``[rows, vocab]``: 5 bytes per vocabulary entry per row (about 0.76 MB a row at
a 152k vocabulary), allocated outside the pool sizing's budget and kept while the
engine lives.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import torch

from kvrunner.plugin_api.buffers import on_device


class TokenHistory:
    """The history rows of one sampler, on ``device``, over a ``vocab``-wide logits row."""

    def __init__(self, vocab: int, device: torch.device) -> None:
        self.vocab = vocab
        self.device = device
        self.prompt = torch.zeros(0, vocab, dtype=torch.bool, device=device)
        self.counts = torch.zeros(0, vocab, dtype=torch.int32, device=device)
        self.recent = torch.full((0, 0), -1, dtype=torch.int64, device=device)

    @property
    def num_rows(self) -> int:
        return self.prompt.shape[0]

    def start(self, init: Mapping[int, tuple[int, int, tuple[int, ...]]]) -> None:
        """Restart the rows of ``init`` (``StepInput.history_init``: history row -> its
        request's prompt length, bad-word window and every token): prompt set, output
        counted, the latest output tokens kept."""
        rows = sorted(init)
        self._fit(rows[-1] + 1, max(window for _, window, _ in init.values()))
        width = self.recent.shape[1]
        flat_rows: list[int] = []
        flat_tokens: list[int] = []
        out_rows: list[int] = []
        out_tokens: list[int] = []
        recent = np.full((len(rows), width), -1, np.int64)
        for i, row in enumerate(rows):
            num_prompt, _, tokens = init[row]
            prompt, output = tokens[:num_prompt], tokens[num_prompt:]
            flat_rows += [row] * len(prompt)
            flat_tokens += prompt
            out_rows += [row] * len(output)
            out_tokens += output
            if width and output:
                tail = output[-width:]
                recent[i, width - len(tail) :] = tail
        index = on_device(np.asarray(rows, np.int64), torch.int64, self.device)
        self.prompt[index] = False
        self.counts[index] = 0
        if flat_rows:
            at = on_device(np.array([flat_rows, flat_tokens], np.int64), torch.int64, self.device)
            self.prompt[at[0], at[1]] = True
        if out_rows:
            at = on_device(np.array([out_rows, out_tokens], np.int64), torch.int64, self.device)
            self.counts.index_put_((at[0], at[1]), torch.ones_like(at[0], dtype=torch.int32),
                                   accumulate=True)  # fmt: skip
        if width:
            self.recent[index] = on_device(recent, torch.int64, self.device)

    def record(self, rows: torch.Tensor, tokens: torch.Tensor) -> None:
        """Add each drawn token to its history row (``rows``: distinct, on the device)."""
        self.counts.index_put_((rows, tokens), torch.ones_like(rows, dtype=torch.int32),
                               accumulate=True)  # fmt: skip
        if self.recent.shape[1]:
            shifted = torch.cat([self.recent[rows, 1:], tokens[:, None]], dim=1)
            self.recent[rows] = shifted

    def _fit(self, rows: int, width: int) -> None:
        """Grow to at least ``rows`` rows and a ``width``-token window (kept rows keep
        their tokens, right-aligned)."""
        have, have_width = self.num_rows, self.recent.shape[1]
        if rows > have:
            grown = max(rows, 2 * have, 8)
            self.prompt = _grown(self.prompt, grown, False)
            self.counts = _grown(self.counts, grown, 0)
            self.recent = _grown(self.recent, grown, -1)
        if width > have_width:
            wider = torch.full((self.recent.shape[0], width), -1, dtype=torch.int64,
                               device=self.device)  # fmt: skip
            if have_width:
                wider[:, width - have_width :] = self.recent
            self.recent = wider


def _grown(t: torch.Tensor, rows: int, fill: bool | int) -> torch.Tensor:
    grown = torch.full((rows, *t.shape[1:]), fill, dtype=t.dtype, device=t.device)
    grown[: t.shape[0]] = t
    return grown
