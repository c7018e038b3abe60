"""The paged backend's own buffer, ``slot_mapping``, and the metadata built around it.

The core stages the shared read side of a step (query start offsets, context
lengths, block tables) once for every backend; what is left to paged is its one
write target: the KV slot each token row stores into. Allocated once at its largest
size and written in place, since captured graphs read it by address.
"""

from __future__ import annotations

import torch

from kvrunner.plugin_api import PAD_SLOT_ID, StepMetadata, fill_head
from kvrunner_paged.metadata import PagedMetadata


class PagedMetadataBuilder:
    """Owns ``slot_mapping`` and hands the layers a :class:`PagedMetadata` per step."""

    def __init__(self, *, max_batch: int, max_tokens: int, device: torch.device) -> None:
        self.max_batch = max_batch
        self.max_tokens = max_tokens
        # The write side starts blank: nothing may be written before a real step fills it.
        self.slot_mapping = torch.full((max_tokens,), PAD_SLOT_ID, dtype=torch.int64, device=device)

    def buffers(self) -> dict[str, torch.Tensor]:
        """The persistent buffers by name (the runner prefixes them with the backend name)."""
        return {"slot_mapping": self.slot_mapping}

    def fill(self, step: StepMetadata) -> PagedMetadata:
        """The step's slots, then PAD on every row past the real tokens (padded rows
        included), so nothing a previous step left there can be written through."""
        fill_head(self.slot_mapping, step.host.slot_mapping[: step.num_tokens], PAD_SLOT_ID)
        return self._metadata(step)

    def fill_capture(self, step: StepMetadata) -> PagedMetadata:
        """Capture metadata: the core's synthesized read side, ``slot_mapping`` exactly
        as the core blanked it (the capture must write no cache row)."""
        return self._metadata(step)

    def _metadata(self, step: StepMetadata) -> PagedMetadata:
        if step.num_padded_tokens > self.max_tokens:
            raise ValueError(
                f"{step.num_padded_tokens} token rows exceed the paged slot_mapping "
                f"({self.max_tokens})"
            )
        return PagedMetadata(
            slot_mapping=self.slot_mapping[: step.num_padded_tokens],
            block_tables=step.block_tables,
            context_lens=step.context_lens,
            query_start_loc=step.query_start_loc,
            num_seqs=step.num_seqs,
            num_padded_seqs=step.num_padded_seqs,
            num_tokens=step.num_tokens,
            max_query_len=step.max_query_len,
            is_decode=step.is_decode,
            calibrates=not (step.is_decode or step.is_capture or step.is_profile),
        )
