"""One request between its submission and its end, as the engine thread tracks it.

A stream's text grows by the new tokens' text only (never the whole output decoded
again), and never says what the final output drops: a request with stop strings
sends only the text its stop watch can no longer take back.
"""

from __future__ import annotations

from typing import Any

import attrs

from kvrunner.async_engine.delta import StreamDelta
from kvrunner.async_engine.handoff import Channel
from kvrunner.engine.incremental_decoder import IncrementalDecoder
from kvrunner.engine.sequence import Sequence
from kvrunner.outputs import RequestOutput

Version = str | int


@attrs.define(eq=False)
class LiveRequest:
    """A submitted request: its engine sequence, where its deltas go, and which
    weight version made which of its tokens."""

    request_id: str
    prompt: Any
    seq: Sequence
    channel: Channel
    #: send a delta after every step that gave it tokens (else only the final one)
    stream: bool
    #: ``(version, first output index)`` spans; the last is the version in force
    versions: list[tuple[Version, int]]
    #: output tokens already sent in deltas
    sent: int = 0
    #: decoded text already sent in deltas
    text: str = ""
    #: the stream's text, decoded as it grows (for a request without a stop watch)
    decoder: IncrementalDecoder | None = attrs.field(default=None, init=False)

    @property
    def num_output_tokens(self) -> int:
        return len(self.seq.token_ids) - self.seq.num_prompt_tokens

    def note_version(self, version: Version) -> None:
        """The weights changed to ``version``: its next token is made under it."""
        start = self.num_output_tokens
        if self.versions and self.versions[-1][1] == start:
            self.versions[-1] = (version, start)  # no token was made under the last one
        else:
            self.versions.append((version, start))

    def version_of(self, index: int) -> Version:
        """The version output token ``index`` was (or will be) made under."""
        return next((v for v, start in reversed(self.versions) if start <= index),
                    self.versions[0][0])

    def spans(self) -> tuple[tuple[Version, int], ...]:
        """The spans that made at least one token (just the first for no token)."""
        n = self.num_output_tokens
        kept = [span for span in self.versions if span[1] < n]
        return tuple(kept or self.versions[:1])

    def delta(self, tokenizer: Any | None) -> StreamDelta | None:
        """The tokens gained since the last delta, or None if there are none."""
        seq = self.seq
        start = seq.num_prompt_tokens + self.sent
        if len(seq.token_ids) <= start:
            return None
        new = seq.token_ids[start:]
        first = self.sent
        self.sent += len(new)
        return self._delta(new, first, self._new_text(tokenizer))

    def final(self, output: RequestOutput) -> StreamDelta:
        """The last delta: the tokens not sent yet, and the whole output."""
        new = output.token_ids[self.sent :]
        first, self.sent = self.sent, len(output.token_ids)
        # the final text is decoded whole: send what the deltas have not yet said
        text = output.text[len(self.text) :] if output.text.startswith(self.text) else ""
        self.text = output.text
        delta = self._delta(new, first, text)
        return attrs.evolve(delta, finish_reason=output.finish_reason, output=output)

    def _delta(self, new: list[int], first: int, text: str) -> StreamDelta:
        seq, wants = self.seq, self.seq.sampling_params.logprobs
        end = first + len(new)
        scored = seq.sampling_params.prompt_logprobs if first == 0 else None
        return StreamDelta(
            request_id=self.request_id,
            token_ids=list(new),
            logprobs=list(seq.logprobs[first:end]) if wants is not None else None,
            top_logprobs=list(seq.top_logprobs[first:end]) if wants else None,
            text=text,
            weight_version=self.version_of(max(end - 1, 0)),
            # as RequestOutput gives them (LLM._output): None for the first prompt token
            prompt_logprobs=None if scored is None else [None, *seq.prompt_logprobs],
            prompt_top_logprobs=[None, *seq.prompt_top_logprobs] if scored else None,
            prompt_ranks=None if scored is None else [None, *seq.prompt_ranks],
            kept_mass=(list(seq.kept_mass[first:end]) if seq.sampling_params.return_kept_mass
                       else None),
        )

    def _new_text(self, tokenizer: Any | None) -> str:
        if tokenizer is None:
            return ""
        seq = self.seq
        watch = seq.stop_watch
        if watch is not None:
            # The engine decodes the output to find the stops: send what no later token
            # can turn into the start of a stop string (the output leaves it out).
            text = watch.streamable_text
        else:
            if self.decoder is None:
                self.decoder = IncrementalDecoder(
                    tokenizer, skip_special_tokens=seq.sampling_params.skip_special_tokens)
            self.decoder.decode_upto(seq.token_ids, seq.num_prompt_tokens, seq.num_output_tokens)
            text = self.decoder.text
        if len(text) <= len(self.text):
            return ""
        new, self.text = text[len(self.text) :], text
        return new
