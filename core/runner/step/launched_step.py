"""A step launched on the device whose tokens the host has not read yet, and the
placeholders of the next step that those tokens fill in on the device.

With asynchronous steps the engine schedules step N+1 before it knows what step N
sampled: a sequence that sampled in step N feeds :data:`~kvrunner.engine.step_io.PLACEHOLDER_TOKEN`
in step N+1. The runner keeps step N's tokens on the device (:class:`DeviceTokens`)
and copies each into the input row of its placeholder before step N+1's forward, so
no token makes a round trip through the host between two steps.
"""

from __future__ import annotations

from collections.abc import Callable

import attrs
import torch

from kvrunner.engine.step_io import (
    PLACEHOLDER_CHUNK,
    PLACEHOLDER_TOKEN,
    PackedSampled,
    SampledTokens,
    StepInput,
    no_samples,
    unpack_sampled,
)
from kvrunner.layers.prompt_logprobs import ScoredPrompts
from kvrunner.layers.sampler import StepSamples
from kvrunner.plugin_api.buffers import on_device
from kvrunner.runner.step.step_routes import ReadRoutes


@attrs.frozen
class DeviceTokens:
    """The tokens one step sampled, on the device: ``token_ids[i]`` is ``seq_ids[i]``'s."""

    seq_ids: list[int]
    token_ids: torch.Tensor  # [len(seq_ids)] int64


class LaunchedStep:
    """One step's samples on their way to the host.

    Created right after the sampler ran: on CUDA the copies into pinned host memory
    are queued behind the step and an event marks their end, so the host is free
    until :meth:`result`; on the CPU the samples are already there.
    """

    def __init__(self, samples: StepSamples | None, prompt: ScoredPrompts | None = None,
                 routes: ReadRoutes | None = None) -> None:
        self._samples = samples
        #: the step's prompt scores (``SamplingParams.prompt_logprobs``), if it made any
        self._prompt = prompt
        #: the step's routed experts (``SamplingParams.return_routed_experts``), if any
        self._routes = routes
        self._event: torch.cuda.Event | None = None
        queued = False
        if prompt is not None and prompt.logprobs.is_cuda:
            self._prompt = prompt.to_host()
            queued = True
        if routes is not None and routes.ids.is_cuda:
            self._routes = routes.to_host()
            queued = True
        if samples is not None and samples.out.token_ids.is_cuda:
            out = samples.out
            host = attrs.evolve(
                out,
                **{
                    name: getattr(out, name).to("cpu", non_blocking=True)
                    for name in ("token_ids", "logprobs", "top_ids", "top_logprobs", "kept_mass")
                    if getattr(out, name) is not None
                },
            )
            self._samples = attrs.evolve(samples, out=host)
            queued = True
        if queued:
            self._event = torch.cuda.Event()
            self._event.record()

    def result(self) -> PackedSampled:
        """The sampled tokens as columns (waits for the step, not for later ones)."""
        if self._event is not None:
            self._event.synchronize()
        prompt = None if self._prompt is None else self._prompt.packed()
        routes = None if self._routes is None else self._routes.packed()
        if self._samples is None:
            return no_samples(prompt, routes)
        packed = self._samples.packed()
        return (*packed[:4], prompt, packed[5], routes)


@attrs.frozen
class SubmittedStep:
    """What an executor's ``submit`` returns: ``result()`` waits for the step's tokens
    (``read``, which answers in columns) and hands them on as columns."""

    read: Callable[[], PackedSampled]

    def result(self) -> SampledTokens:
        return unpack_sampled(self.read())


def placeholder_rows(step: StepInput, previous: DeviceTokens | None) -> tuple[list[int], list[int]]:
    """For each placeholder in ``step``: its token row in the flat batch and the row of
    ``previous`` holding its token. Raises if a placeholder has no such token."""
    where: dict[int, int] | None = None
    token_rows: list[int] = []
    sample_rows: list[int] = []
    end = 0
    for seq_id, tokens in zip(step.seq_id, step.token_ids, strict=True):
        end += len(tokens)
        if PLACEHOLDER_TOKEN not in tokens:  # a C-level scan of the tuple
            continue
        if tokens[-1] != PLACEHOLDER_TOKEN or tokens.count(PLACEHOLDER_TOKEN) != 1:
            raise ValueError(f"sequence {seq_id}: a placeholder is only ever a chunk's last token")
        if where is None:
            where = {s: i for i, s in enumerate(previous.seq_ids)} if previous else {}
        row = where.get(seq_id)
        if row is None:
            raise RuntimeError(
                f"sequence {seq_id} feeds the token it sampled in the previous step, but "
                f"that step sampled none for it"
            )
        token_rows.append(end - 1)
        sample_rows.append(row)
    return token_rows, sample_rows


def feed_placeholders(
    input_ids: torch.Tensor, step: StepInput, previous: DeviceTokens | None
) -> None:
    """Write ``previous``'s tokens into ``input_ids`` at ``step``'s placeholders, on the
    device (``input_ids`` already holds the step's known tokens)."""
    n = len(step.seq_id)
    if (
        previous is not None
        and step.seq_id == previous.seq_ids
        and step.token_ids.count(PLACEHOLDER_CHUNK) == n
    ):
        # Every row decodes its last step's token, in that step's order (C-level list
        # compares): one copy, and no per-row work on the host.
        input_ids[:n].copy_(previous.token_ids)
        return
    token_rows, sample_rows = placeholder_rows(step, previous)
    if not token_rows:
        return
    assert previous is not None
    device = input_ids.device
    dst = on_device(token_rows, torch.int64, device)
    src = on_device(sample_rows, torch.int64, device)
    input_ids.index_copy_(0, dst, previous.token_ids.index_select(0, src))
